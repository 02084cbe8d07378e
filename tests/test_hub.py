"""Models by Hugging Face id, resolved against a cache folder laid out as huggingface_hub lays it out
(blobs, snapshot symlinks, refs), with the network off: never against the Hub itself."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from huggingface_hub import constants

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.cli import main
from tokenmill.hub import HubError, is_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str, ref: str) -> None:
    """``folder``'s files as huggingface_hub caches a snapshot: content-addressed blobs, the
    snapshot's files as relative symlinks to them, and ``refs/<ref>`` naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An offline Hugging Face cache holding ``org/tiny`` (main -> COMMIT), and the folder it came from."""
    folder = tmp_path / "tiny"
    save_tiny_checkpoint(folder, "llama")
    cache = tmp_path / "hub"
    lay_out_hub_cache(cache, "org/tiny", folder, COMMIT, "main")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, folder


def greedy(llm: LLM) -> list[int]:
    try:
        return (
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
    finally:
        llm.shutdown()


@pytest.mark.parametrize("revision", [None, "main", COMMIT])
def test_a_cached_model_id_runs_offline_as_its_folder(hub_cache: tuple[Path, Path], revision: str | None) -> None:
    _, folder = hub_cache
    by_id = LLM(model="org/tiny", revision=revision, dtype="float32", num_kv_slots=256)
    assert by_id.engine.config.model_name() == "org/tiny"
    assert greedy(by_id) == greedy(LLM(model=str(folder), dtype="float32", num_kv_slots=256))


@pytest.mark.parametrize(
    ("model", "revision", "message"),
    [
        ("org/missing", None, "'org/missing' is not a local folder and not in the Hugging Face cache"),
        ("org/tiny", "v2", "'org/tiny' at revision v2 is not a local folder"),
    ],
)
def test_an_uncached_id_offline_says_what_to_do(hub_cache, model: str, revision: str | None, message: str) -> None:
    with pytest.raises(HubError, match=message) as refused:
        LLM(model=model, revision=revision, dtype="float32")
    assert f"run `tokenmill pull {model}`" in str(refused.value)


def test_pull_offline_fails_with_a_message_and_list_shows_the_cache(
    hub_cache, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pull", "org/missing"]) == 1
    assert "could not download org/missing" in capsys.readouterr().err
    assert main(["list"]) == 0
    repo_id, size, refs = capsys.readouterr().out.strip().split("\t")
    assert (repo_id, refs) == ("org/tiny", "main") and float(size.split()[0]) > 0


def test_paths_win_over_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("org/name") and not is_repo_id("/abs/path") and not is_repo_id("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_repo_id("org/name")  # a folder of that name here: a path
