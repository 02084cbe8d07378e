"""The int8 KV cache (``kv_cache_dtype="int8"``): its format against a plain reference, the C++
decode kernel and the C++ decode forward against the torch reference over the same int8 cache,
and the engine: greedy tokens equal the fp32-KV run's where its margins are clear, logprobs close,
prefix sharing, forks and preemption unchanged, twice the tokens for the same bytes, and clear
refusals where it is not supported."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.attention.helpers import PagedLayout
from tests.model.test_bf16 import GREEDY_TOKENS, GREEDY_VOCAB, MIN_MARGIN, candidate_prompts, min_margin
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention.cpu_backend import CpuBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.kv_quant import LayerKV, dequantize, quantize
from tokenmill.cache.storage import KVStorage
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")


def test_quantize_rounds_each_head_to_its_own_scale() -> None:
    x = torch.randn(5, 3, 16) * torch.tensor([0.01, 1.0, 100.0])[None, :, None]
    x[2, 1] = 0.0
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 3)
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    assert int(q.abs().max()) == 127 and torch.equal(q[2, 1], torch.zeros(16, dtype=torch.int8))
    error = (dequantize(q, scale, torch.float32) - x).abs()
    assert bool((error <= scale[..., None] / 2 * (1 + 1e-6)).all())  # round to nearest: half a step at most


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_store_and_read_equal_the_torch_code(dtype: torch.dtype) -> None:
    """``kv_int8.cpp`` stores and reads exactly what ``kv_quant``'s torch code does, ties to even included."""
    from tokenmill.kernels.cpu import load_cpu_kernels

    x = (torch.randn(40, 3, 24) * 4).to(dtype)
    x[0, 0] = 0.0
    x[1, 0, :2] = torch.tensor([127.0, 0.5])  # scale 1: 0.5 is a tie, rounded to even
    slots = torch.randperm(99)[:40] + 1
    stores = []
    for kernels in (None, load_cpu_kernels()):
        storage = KVStorage(1, 100, 3, 24, torch.int8, "cpu")
        cache = LayerKV(storage.k_buffer[0], storage.v_buffer[0], storage.k_scale[0], storage.v_scale[0], kernels)
        cache.store(slots, x, -x)
        stores.append((storage, cache.read(slots.flip(0), dtype)))
    (torch_storage, torch_read), (cpp_storage, cpp_read) = stores
    for name in ("k_buffer", "v_buffer", "k_scale", "v_scale"):  # the written slots (the rest is uninitialized)
        assert torch.equal(getattr(torch_storage, name)[0, slots], getattr(cpp_storage, name)[0, slots]), name
    assert int(torch_storage.k_buffer[0, slots[1], 0, 1]) == 0
    assert torch.equal(torch_read[0], cpp_read[0]) and torch.equal(torch_read[1], cpp_read[1])


def int8_storage(n_slots: int, n_kv: int, head_dim: int) -> KVStorage:
    storage = KVStorage(2, n_slots, n_kv, head_dim, torch.int8, "cpu")
    for buffer, scales in ((storage.k_buffer, storage.k_scale), (storage.v_buffer, storage.v_scale)):
        q, s = quantize(torch.randn(2, n_slots - 1, n_kv, head_dim))
        buffer[:, 1:], scales[:, 1:] = q, s
    return storage


@needs_compiler
@pytest.mark.parametrize(("n_heads", "n_kv", "head_dim", "page"), [(4, 4, 64, 1), (12, 4, 64, 16), (8, 2, 24, 16)])
def test_cpu_decode_kernel_reads_int8_as_the_reference(n_heads: int, n_kv: int, head_dim: int, page: int) -> None:
    """Long contexts (several of the kernel's chunks) and short ones, head_dim 64 (compile-time
    path) and 24 (run-time path): the kernel reads the int8 values and scales in place."""
    torch.manual_seed(0)
    context = [700, 5, 300, 64]
    layout = PagedLayout(page, n_pages=4 + sum(context) // page + 2 * len(context), rows=4, context=1024)
    storage = int8_storage(layout.allocator.n_pages * page, n_kv, head_dim)
    rows = [layout.new_row() for _ in context]
    layout.extend_interleaved(rows, context)
    loc = torch.cat(layout.extend_interleaved(rows, [1] * len(rows)))
    view = make_decode_view(storage, layout.pool.table, rows, [layout.lens[r] for r in rows], loc)
    q = torch.randn(len(rows), n_heads, head_dim)
    k, v = torch.randn(len(rows), n_kv, head_dim), torch.randn(len(rows), n_kv, head_dim)
    expected = TorchNativeBackend(n_heads, n_kv, head_dim).forward(q, k, v, 1, view)
    out = CpuBackend(n_heads, n_kv, head_dim).forward(q, k, v, 1, view)
    assert (out - expected).abs().max().item() <= 1e-5


@needs_compiler
def test_cpu_prefill_over_an_int8_prefix_matches_the_reference() -> None:
    torch.manual_seed(1)
    layout = PagedLayout(1, n_pages=400, rows=3, context=200)
    storage = int8_storage(400, 2, 64)
    rows = [layout.new_row() for _ in range(3)]
    prefix, extend = [0, 40, 3], [45, 33, 1]
    layout.extend_interleaved(rows, prefix)
    loc = torch.cat(layout.extend_interleaved(rows, extend))
    view = make_prefill_view(storage, layout.pool.table, rows, prefix, extend, loc)
    n = sum(extend)
    q, k, v = torch.randn(n, 6, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)
    expected = TorchNativeBackend(6, 2, 64).forward(q, k, v, 1, view)
    assert (CpuBackend(6, 2, 64).forward(q, k, v, 1, view) - expected).abs().max().item() <= 1e-5


def greedy(path: Path, prompts: list[list[int]], **options: object) -> list:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(model=str(path), device="cpu", num_kv_slots=4096, skip_tokenizer_init=True, **options)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("int8-kv")
    save_tiny_model(path, "llama", vocab_size=GREEDY_VOCAB)
    return path


@pytest.mark.parametrize(("backend", "dtype"), [("torch", "float32"), ("cpu", "float32"), ("cpu", "bfloat16")])
def test_greedy_tokens_equal_the_fp32_kv_run_where_margins_are_clear(model: Path, backend: str, dtype: str) -> None:
    candidates = candidate_prompts()
    reference = greedy(model, candidates, dtype="float32")
    clear = [i for i, out in enumerate(reference) if min_margin(out) >= MIN_MARGIN]
    assert len(clear) >= 4, "too few prompts with clear margins for a meaningful check"
    ours = greedy(model, [candidates[i] for i in clear], dtype=dtype, kv_cache_dtype="int8", attention_backend=backend)
    assert [o.token_ids for o in ours] == [reference[i].token_ids for i in clear]
    if dtype == "float32":  # the KV's rounding is the only difference: logprobs stay close
        gaps = [
            abs(entry[t].logprob - ref_entry[t].logprob)
            for o, i in zip(ours, clear)
            for t, entry, ref_entry in zip(o.token_ids, o.logprobs, reference[i].logprobs)
        ]
        assert max(gaps) < 0.05, max(gaps)


@needs_compiler
def test_the_cpu_decode_forward_runs_int8_as_the_step_by_step_path(model: Path) -> None:
    """The whole-step C++ decode forward stores (quantizes) and reads the int8 cache exactly as the
    backend's per-layer path: equal tokens and logprobs."""
    prompts = candidate_prompts()[:12]
    llm = LLM(model=str(model), dtype="float32", kv_cache_dtype="int8", num_kv_slots=4096, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        fused = llm.engine.worker.cpu_decode
        assert fused is not None and fused.can_run(len(prompts)), "the decode forward must run over an int8 cache"
        whole_step = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.worker.cpu_decode = None  # per layer through the backend
        per_layer = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for a, b in zip(whole_step, per_layer):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: round(lp.logprob, 4) for t, lp in x.items()} == {t: round(lp.logprob, 4) for t, lp in y.items()}


def test_prefix_sharing_forks_and_preemption_keep_outputs(model: Path) -> None:
    """n=3 siblings (the partial page and its scales copied), a shared cached prefix, and a pool
    small enough to preempt: each request's tokens equal the same request run alone."""
    together, alone, stats, kv_dtype = together_and_alone(model, kv_cache_dtype="int8")
    assert kv_dtype == torch.int8
    assert stats["scheduler"]["preemptions"] > 0 and stats["cache"]["prefix_hit_tokens"] > 0
    assert together == alone


def together_and_alone(model: Path, **options: object) -> tuple[list, list, dict, torch.dtype]:
    """Six requests (n=3) sharing a cached prefix, run together on a pool small enough to preempt,
    then each alone on a large pool without prefix caching: both runs' tokens, the first run's
    stats and its KV dtype."""
    prompts = [candidate_prompts()[40] + [3 + i] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=3)
    options = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, **options)
    llm = LLM(model=str(model), num_kv_slots=256, max_num_batched_tokens=32, **options)
    try:
        kv_dtype = llm.engine.worker.storage.k_buffer.dtype
        together = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    alone_engine = LLM(model=str(model), num_kv_slots=4096, enable_prefix_caching=False, **options)
    try:
        alone = [[c.token_ids for c in alone_engine.generate([p], params, use_tqdm=False)[0].outputs] for p in prompts]
    finally:
        alone_engine.shutdown()
    return together, alone, stats, kv_dtype


def test_int8_holds_about_twice_the_tokens_of_bf16() -> None:
    int8 = KVStorage.bytes_per_slot(30, 3, 64, torch.int8)
    bf16 = KVStorage.bytes_per_slot(30, 3, 64, torch.bfloat16)
    assert int8 == 2 * 30 * 3 * (64 + 4) and bf16 / int8 == pytest.approx(128 / 68)


def test_refusals(model: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        LLM(model=str(model), kv_cache_dtype="int4")
