"""The repacked-weights cache: a later start reads the weights a load repacked, bit for bit, without
repacking; a file that is not exactly the one for this load is a miss that loads from the source."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from tests.gguf_files import save_gguf
from tests.model.test_parity import greedy_through_cache
from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.gguf_checkpoint import checkpoint_folder, read_index
from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.model import repacked_cache
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.quantization import quantize_model
from tokenmill.model.repacked_cache import cache_file, load_repacked

Q = GGMLQuantizationType
INT4 = QuantScheme(4, None, symmetric=False)
PROMPTS = [[5, 6, 7], list(range(3, 30))]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(root))
    yield root


@pytest.fixture
def gguf_folder(tmp_path: Path) -> Path:
    """A tiny Llama GGUF (Q4_1 projections, Q8_0 untied head), converted: its checkpoint folder."""
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    save_gguf(path, "llama", Q.Q4_1, Q.Q8_0, tie_word_embeddings=False)
    return checkpoint_folder(path)


def state(model: CausalLM) -> dict[str, torch.Tensor]:
    """Every tensor a load leaves in ``model`` (parameters and quantized buffers), by name."""
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    tensors |= {name: b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1].startswith("q")}
    return tensors


def schemes(model: CausalLM) -> dict[str, QuantScheme | None]:
    return {n: m.quantization for n, m in model.named_modules() if isinstance(m, Linear)}


def assert_same_model(restored: CausalLM, loaded: CausalLM) -> None:
    expected, got = state(loaded), state(restored)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert schemes(restored) == schemes(loaded)
    assert restored.quantization == loaded.quantization
    assert restored.checkpoint_quantization == loaded.checkpoint_quantization
    (restored_logits, restored_tokens), (logits, tokens) = (
        greedy_through_cache(m, PROMPTS) for m in (restored, loaded)
    )
    assert restored_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(restored_logits, logits))


def forbid_repacking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any load from the source (rather than from the cache) fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("loaded from the source")

    monkeypatch.setattr(repacked_cache, "load_model", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_file_starts_from_its_repacked_weights_bit_for_bit(
    gguf_folder: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_repacked(gguf_folder, dtype, None)
    file = cache_file(gguf_folder, dtype, None)
    assert file is not None and file.is_file()
    assert first.checkpoint_quantization == "gguf" and any(s is not None for s in schemes(first).values())
    assert_same_model(first, load_model(gguf_folder, dtype, "cpu"))
    with safe_open(str(file), "pt") as stored:  # a safetensors file: the library reads it
        assert all(torch.equal(stored.get_tensor(name), tensor) for name, tensor in state(first).items())
    forbid_repacking(monkeypatch)
    assert_same_model(load_repacked(gguf_folder, dtype, None), first)


AT_LOAD_CASES = {
    "mixtral_unstacked_experts": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2_tied_head_quantized_on_its_own": ("qwen2", dict(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", AT_LOAD_CASES)
def test_an_at_load_quantized_checkpoint_is_cached_per_scheme(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "hf"
    kind, overrides = AT_LOAD_CASES[case]
    save_tiny_checkpoint(folder, kind, **overrides)
    oracle = load_model(folder, torch.float32, "cpu")
    quantize_model(oracle, INT4)
    first = load_repacked(folder, torch.float32, INT4)
    assert_same_model(first, oracle)
    int8 = cache_file(folder, torch.float32, QuantScheme(8))
    assert int8 is not None and int8 != cache_file(folder, torch.float32, INT4) and not int8.exists()
    assert cache_file(folder, torch.float32, None) is None  # loaded as it is: nothing to cache
    forbid_repacking(monkeypatch)
    assert_same_model(load_repacked(folder, torch.float32, INT4), oracle)


def rewrite_header(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """A file change: its header edited by ``edit`` (the header's length kept valid)."""

    def change(file: Path) -> None:
        data = file.read_bytes()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        edit(header)
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        file.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data[8 + size :])

    return change


def other_key(header: dict) -> None:
    manifest = json.loads(header["__metadata__"]["manifest"])
    manifest["key"]["dtype"] = "torch.float16"
    header["__metadata__"]["manifest"] = json.dumps(manifest)


def wider_tensor(header: dict) -> None:
    name = next(n for n in header if n.endswith("input_layernorm.weight"))
    header[name]["shape"] = [header[name]["shape"][0] * 2]


def unknown_tensor(header: dict) -> None:
    name = next(n for n in header if n.endswith("input_layernorm.weight"))
    header[name.replace("input_layernorm", "extra_norm")] = header.pop(name)


BAD_FILES: dict[str, Callable[[Path], None]] = {
    "truncated": lambda file: file.write_bytes(file.read_bytes()[:-100]),
    "longer": lambda file: file.write_bytes(file.read_bytes() + b"\0" * 64),
    "not_safetensors": lambda file: file.write_bytes(b"not a cache file at all"),
    "empty": lambda file: file.write_bytes(b""),
    "made_for_another_load": rewrite_header(other_key),
    "a_tensor_of_another_shape": rewrite_header(wider_tensor),
    "a_tensor_the_model_lacks": rewrite_header(unknown_tensor),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_is_a_miss_that_loads_from_the_source_and_is_written_again(
    case: str, gguf_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = load_repacked(gguf_folder, torch.float32, None)
    file = cache_file(gguf_folder, torch.float32, None)
    assert file is not None
    good = file.read_bytes()
    BAD_FILES[case](file)
    with caplog.at_level(logging.WARNING, logger="tokenmill.model"):
        assert_same_model(load_repacked(gguf_folder, torch.float32, None), first)
    assert "not used" in caplog.text and str(file) in caplog.text
    assert file.read_bytes() == good


def test_a_changed_source_file_misses_and_its_old_entry_goes(gguf_folder: Path) -> None:
    load_repacked(gguf_folder, torch.float32, None)
    old = cache_file(gguf_folder, torch.float32, None)
    assert old is not None and old.is_file()
    index = read_index(gguf_folder)
    assert index is not None
    gguf = Path(index["file"])
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    folder = checkpoint_folder(gguf)
    load_repacked(folder, torch.float32, None)
    new = cache_file(folder, torch.float32, None)
    assert new is not None and new != old and new.is_file() and not old.exists()


def test_nothing_is_written_with_the_cache_off_or_for_a_plain_checkpoint(tmp_path: Path, cache_dir: Path) -> None:
    folder = tmp_path / "hf"
    save_tiny_checkpoint(folder)
    load_repacked(folder, torch.float32, INT4, enabled=False)
    load_repacked(folder, torch.float32, None)
    assert not (cache_dir / "repacked").exists()


def test_a_second_engine_start_reads_the_cache_and_generates_the_same(
    gguf_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def greedy() -> list[list[int]]:
        llm = LLM(model=str(gguf_folder), dtype="bfloat16")
        try:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    first = greedy()
    forbid_repacking(monkeypatch)
    assert greedy() == first
