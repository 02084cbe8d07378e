"""Weight updates under load: no torn weights, versions tagged per token, all-or-nothing
validation, and no reuse of KV computed under old weights after a cache flush."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, Engine, SamplingParams
from tokenmill.model.loader import WeightError
from tokenmill.request import RequestOutput, accumulate

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PERTURBED = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)] + ["model.layers.0.self_attn.k_proj.weight"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rl-llama")
    save_tiny_checkpoint(path, "llama")
    return path


def weights_for(base: dict[str, torch.Tensor], version: int) -> list[tuple[str, torch.Tensor]]:
    """Version k: the base weights of PERTURBED plus a perturbation seeded by k (not cumulative)."""
    gen = torch.Generator().manual_seed(version)
    return [(n, base[n] + 0.5 * torch.randn(base[n].shape, generator=gen)) for n in PERTURBED]


def checkpoint_of(checkpoint: Path, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """``checkpoint``'s config and tokenizer with ``weights`` in its safetensors file, saved to ``folder``."""
    shutil.copytree(checkpoint, folder)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def generate_observed(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[RequestOutput, list[int]]:
    """The request's output, and for each of its tokens the engine's weight version when the delta carrying the
    token was emitted: callbacks run on the engine thread right after the step that sampled the delta's tokens,
    and a weight update only ever applies between steps, so that is the version that produced the token."""
    done = threading.Event()
    total: list[RequestOutput | None] = [None]
    observed: list[int] = []

    def on_output(delta: RequestOutput) -> None:
        version = engine.weight_version
        total[0] = accumulate(total[0], delta)
        observed.extend([version] * sum(len(c.token_ids) for c in delta.outputs))
        if delta.finished:
            done.set()

    engine.add_request(prompt, params, on_output)
    assert done.wait(60)
    return total[0], observed


def test_concurrent_generation_and_twenty_updates(checkpoint: Path, tmp_path: Path) -> None:
    base = load_file(checkpoint / "model.safetensors")
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=4096)
    engine = llm.engine
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    records: list[tuple[int, list[int], RequestOutput, list[int]]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()

    def generate_forever(worker: int) -> None:
        try:
            while not stop.is_set():
                prompt = prompts[worker]
                started_version = engine.weight_version
                out, observed = generate_observed(engine, prompt, GREEDY)
                with lock:
                    records.append((started_version, prompt, out, observed))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=generate_forever, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    try:
        for version in range(1, 21):
            assert llm.update_weights(weights_for(base, version)) == version
            seen = len(records)
            deadline = time.monotonic() + 30
            while len(records) < seen + 2 and time.monotonic() < deadline:  # let requests run in between
                time.sleep(0.005)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not errors
    assert engine.weight_version == 20
    assert len(records) >= 40
    llm.shutdown()
    for _, _, out, observed in records:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 6
        assert completion.weight_versions == observed  # each token carries the version that produced it
    assert any(len(set(observed)) > 1 for *_, observed in records)  # some requests ran across an update

    # requests that ran entirely under one version k produce the greedy tokens of an engine freshly loaded
    # from a checkpoint holding weights k (the reference never goes through update_weights)
    by_version: dict[int, dict[tuple, list[int]]] = {}
    for started, prompt, out, _ in records:
        versions = set(out.outputs[0].weight_versions)
        if len(versions) == 1 and started <= min(versions):
            by_version.setdefault(versions.pop(), {})[tuple(prompt)] = out.outputs[0].token_ids
    assert len(by_version) >= 3
    for version, outputs in sorted(by_version.items()):
        weights = {**base, **dict(weights_for(base, version))} if version else base
        fresh = LLM(
            dtype="float32", model=str(checkpoint_of(checkpoint, weights, tmp_path / f"v{version}")), num_kv_slots=1024
        )
        try:
            got = fresh.generate([list(p) for p in outputs], GREEDY, use_tqdm=False)
        finally:
            fresh.shutdown()
        assert [o.outputs[0].token_ids for o in got] == list(outputs.values()), f"weights of version {version}"


@pytest.mark.parametrize(
    "bad, message",
    [
        (("model.layers.0.mlp.rogue.weight", torch.zeros(3)), "unexpected tensor 'model.layers.0.mlp.rogue.weight'"),
        (("model.layers.1.self_attn.v_proj.weight", torch.zeros(5, 64)), r"has shape \(5, 64\), expected \(32, 64\)"),
        (("model.norm.weight", torch.ones(64, dtype=torch.int32)), "has dtype torch.int32"),
    ],
)
def test_invalid_update_changes_nothing(checkpoint: Path, bad: tuple, message: str) -> None:
    # no prefix cache: both runs take the same computation path, so outputs must be bit-identical
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=1024, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
        good = ("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 96))
        with pytest.raises(WeightError, match=message):
            llm.update_weights([good, bad, good])
        assert llm.weight_version == 0
        after = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
        assert after.token_ids == before.token_ids
        assert [lp[t].logprob for lp, t in zip(after.logprobs, after.token_ids)] == [
            lp[t].logprob for lp, t in zip(before.logprobs, before.token_ids)
        ]
    finally:
        llm.shutdown()


def test_flush_recomputes_cached_prompts_with_new_weights(checkpoint: Path, tmp_path: Path) -> None:
    new = tmp_path / "new"
    save_tiny_checkpoint(new, "llama", seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    prompt = list(range(10, 30))
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=1024)
    fresh = LLM(dtype="float32", model=str(new), num_kv_slots=1024)  # reference: loaded from the new checkpoint
    try:
        expected = fresh.generate([prompt], params, use_tqdm=False)[0].outputs[0]

        llm.generate([prompt], params, use_tqdm=False)  # caches the prompt under the old weights
        hits = llm.engine.stats()["cache"]["prefix_hit_tokens"]
        llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.stats()["cache"]["prefix_hit_tokens"] > hits  # the cache would be reused

        assert llm.update_weights(new, version=5) == 5
        hits = llm.engine.stats()["cache"]["prefix_hit_tokens"]
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert llm.engine.stats()["cache"]["prefix_hit_tokens"] == hits  # recomputed from scratch
        assert out.token_ids == expected.token_ids and out.weight_versions == [5] * 5
        for ours, ref, tok in zip(out.logprobs, expected.logprobs, out.token_ids):
            assert abs(ours[tok].logprob - ref[tok].logprob) <= 1e-5
    finally:
        llm.shutdown()
        fresh.shutdown()


def test_pause_holds_steps_and_resume_continues(checkpoint: Path) -> None:
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=1024)
    engine = llm.engine
    try:
        engine.pause_generation()
        done = threading.Event()
        total: list[RequestOutput | None] = [None]

        def collect(delta: RequestOutput) -> None:
            total[0] = accumulate(total[0], delta)
            if delta.finished:
                done.set()

        engine.add_request([5, 6, 7], GREEDY, collect)
        assert not done.wait(0.5)
        assert engine.stats()["scheduler"]["steps"] == 0
        engine.resume_generation()
        assert done.wait(30) and len(total[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()
