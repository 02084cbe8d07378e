"""The Triton backend over an fp8 KV cache (Triton's interpreter on CPU, tiny shapes).

Oracles: the store kernel writes exactly ``kv_fp8.to_fp8``'s bytes for e4m3fn and e5m2 (saturation,
ties to even, subnormals, zeros and negative zero, inf and NaN; fp32 and fp16 inputs, and every
fp16 value); split-KV decode and ragged prefill over an fp8 cache equal the torch reference backend
over the same fp8 cache (fp32 and fp16 queries, GQA, page sizes 1 and 16, contexts across the
kernels' 64-key chunks and across split boundaries, a sliding window); and an engine on a tiny Llama
with ``kv_cache_dtype="fp8_e4m3"`` gives the torch backend's greedy tokens; the CUDA-graph runner's
static decode view (run eagerly) over an fp8 cache gives the eager decode's logits.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton")

from tests.attention.cache_pair import CachePair, static_decode_error  # noqa: E402
from tests.tiny_models import save_tiny_checkpoint  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.attention.triton.store import store_kv  # noqa: E402
from tokenmill.attention.triton_capabilities import TRITON_CAPABILITIES  # noqa: E402
from tokenmill.cache.kv_fp8 import FP8_DTYPES, to_fp8  # noqa: E402
from tokenmill.cache.storage import KVStorage  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}
GREEDY = dict(temperature=0.0, ignore_eos=True)
FP8_IDS = [str(d).removeprefix("torch.float8_") for d in FP8_DTYPES]


def test_capabilities_read_fp8() -> None:
    assert TRITON_CAPABILITIES.kv_fp8
    assert all(TRITON_CAPABILITIES.reads_kv(torch.float16, fp8) for fp8 in FP8_DTYPES)


def edge_values(fp8: torch.dtype) -> torch.Tensor:
    """Values at the format's edges: beyond the max (saturate), the max's rounding tie, ties between
    neighbours, subnormals and their ties, zeros, inf and NaN."""
    big, tiny = torch.finfo(fp8).max, torch.finfo(fp8).smallest_normal
    sub = tiny / (8 if fp8 == torch.float8_e4m3fn else 4)  # the smallest subnormal
    ulp1 = 2 ** -(3 if fp8 == torch.float8_e4m3fn else 2)  # spacing just above 1
    values = [big, big * 1.03, big * 1.2, 1e9, float("inf"), 0.0, -0.0, float("nan")]
    values += [1 + ulp1 / 2, 1 + 3 * ulp1 / 2, 1 + ulp1 / 2 + 2**-20, 2.5, 3.5, tiny, tiny * 0.999]
    values += [sub, sub / 2, 3 * sub / 2, 5 * sub / 2, sub / 2 + 2**-30, sub / 4, 2**-40]
    values = torch.tensor(values, dtype=torch.float64)
    return torch.cat([values, -values]).float()


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_writes_kv_fp8_bytes(fp8: torch.dtype, dtype: torch.dtype) -> None:
    """The cache's bytes equal ``to_fp8``'s bit for bit (edge values, every fp16 value, random ones);
    other slots are left alone."""
    torch.manual_seed(0)
    every_fp16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    edges = edge_values(fp8).to(dtype)
    values = torch.cat([edges, every_fp16.to(dtype), (torch.randn(4096) * 30).to(dtype)])
    x = torch.cat([values, values.new_zeros(-values.numel() % 1024)]).view(-1, 4, 256)  # [T, Hkv, D]: few programs
    n = x.shape[0]
    slots = torch.randperm(n + 9)[:n] + 1
    k_cache = torch.full((n + 10, 4, 256), 0x55, dtype=torch.uint8).view(fp8)
    v_cache = k_cache.clone()
    store_kv(x, -x, k_cache, v_cache, slots)
    for cache, written in ((k_cache, x), (v_cache, -x)):
        stored = cache.view(torch.uint8)[slots]
        assert torch.equal(stored, to_fp8(written, fp8).view(torch.uint8))
    edge_bytes = k_cache.view(torch.uint8)[slots].reshape(-1)[: edges.numel()]
    assert edge_bytes[:3].tolist() == [0x7E if fp8 == torch.float8_e4m3fn else 0x7B] * 3  # saturated
    assert edge_bytes[5:7].tolist() == [0x00, 0x80]  # 0.0, -0.0
    untouched = torch.ones(n + 10, dtype=torch.bool)
    untouched[slots] = False
    assert bool((k_cache.view(torch.uint8)[untouched] == 0x55).all())


def fp8_storage(fp8: torch.dtype, n_slots: int, n_kv: int, head_dim: int) -> KVStorage:
    """An fp8 storage whose slots (but the zeroed slot 0) hold random fp8 keys/values."""
    storage = KVStorage(2, n_slots, n_kv, head_dim, fp8, "cpu")
    for buffer in (storage.k_buffer, storage.v_buffer):
        raw = buffer.view(torch.uint8)
        raw.zero_()
        raw[:, 1:] = to_fp8(torch.randn(2, n_slots - 1, n_kv, head_dim) * 2, fp8).view(torch.uint8)
    return storage


# (fp8 dtype, query dtype, head_dim, GQA group, page_size, window); n_kv_heads = N_HEADS // group
CASES = [
    (torch.float8_e4m3fn, torch.float32, 32, 2, 16, None),
    (torch.float8_e5m2, torch.float16, 64, 4, 1, None),
    (torch.float8_e4m3fn, torch.float16, 16, 2, 1, None),
    (torch.float8_e5m2, torch.float32, 24, 1, 16, 5),  # head_dim not a power of two; a sliding window
]


def case_id(case: tuple) -> str:
    fp8, dtype, head_dim, group, page, window = case
    return f"{str(fp8).removeprefix('torch.float8_')}-{str(dtype)[6:]}-d{head_dim}-g{group}-p{page}-w{window}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefill_then_decode_over_fp8_match_torch(case: tuple) -> None:
    """Prefill (fresh, one-token extend, two q tiles over a 60-token prefix: keys across the 64-key
    chunk) and decode with one split and with several, against the reference on the same cache."""
    fp8, dtype, head_dim, group, page, window = case
    torch.manual_seed(head_dim)
    pair = CachePair(partial(fp8_storage, fp8), dtype, head_dim, group, page)
    rows = [pair.layout.new_row() for _ in range(3)]
    prefix, extend = [0, 5, 60], [7, 1, 10]
    pair.layout.extend_interleaved(rows, prefix)  # a cached prefix: fp8 keys/values already stored
    assert pair.prefill(rows, prefix, extend, window) <= TOLERANCE[dtype]
    assert pair.decode(rows, min_tokens=64, window=window) <= TOLERANCE[dtype]  # lens 8, 7, 71: 1, 1, 2 splits
    assert pair.decode(rows, min_tokens=3, window=window) <= TOLERANCE[dtype]  # 3, 3 and 4 (capped) splits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-triton-fp8")
    save_tiny_checkpoint(path, "llama")
    return path


def test_cuda_graph_static_decode_reads_fp8(checkpoint: Path) -> None:
    """The runner's padded static decode view (run eagerly on CPU) over an fp8 e5m2 cache gives the
    eager decode's logits."""
    assert static_decode_error(checkpoint, torch.float8_e5m2) <= 1e-5


def test_engine_greedy_tokens_match_torch_backend_over_fp8(checkpoint: Path) -> None:
    prompts = [list(range(3, 8)), [(7 * i) % 90 + 4 for i in range(19)], [(5 * i) % 80 + 6 for i in range(34)]]
    options = dict(
        device="cpu",
        dtype="float32",
        kv_cache_dtype="fp8_e4m3",
        num_kv_slots=256,
        page_size=16,
        max_running_requests=4,
        max_num_batched_tokens=24,
        max_decode_splits=2,
        decode_split_min_tokens=8,
        cuda_graphs=False,
    )
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(checkpoint), attention_backend=backend, **options)
        try:
            engine = llm.engine
            assert engine.model.backend.name == backend and engine.worker.storage.k_buffer.dtype == torch.float8_e4m3fn
            outputs = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
            stats = engine.stats()
        finally:
            llm.shutdown()
        assert stats["scheduler"]["chunked_prefills"] > 0
        results[backend] = [o.outputs[0].token_ids for o in outputs]
    assert results["triton"] == results["torch"]
