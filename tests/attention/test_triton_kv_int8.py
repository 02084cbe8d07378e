"""The Triton backend over an int8 KV cache (Triton's interpreter on CPU, tiny shapes).

Oracles: the store kernel writes exactly ``kv_quant.quantize``'s int8 values and scales (ties to
even, all-zero heads, fp32 and fp16 inputs); split-KV decode and ragged prefill over an int8 cache
equal the torch reference backend over the same int8 cache (fp32 and fp16 queries, GQA, page sizes
1 and 16, contexts across the kernels' 64-key chunks and across split boundaries, a sliding
window); the CUDA-graph runner's static decode view carries the scales; and an engine on a tiny
Llama with ``kv_cache_dtype="int8"`` gives the torch backend's greedy tokens, with prefix caching
and chunked prefill in the mix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton")

from tests.attention.cache_pair import CachePair, static_decode_error  # noqa: E402
from tests.tiny_models import save_tiny_checkpoint  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.attention.triton.store import store_kv  # noqa: E402
from tokenmill.attention.triton_capabilities import TRITON_CAPABILITIES  # noqa: E402
from tokenmill.cache.kv_quant import quantize  # noqa: E402
from tokenmill.cache.storage import KVStorage  # noqa: E402
from tokenmill.engine.sequence import Sequence  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_capabilities_read_int8() -> None:
    assert TRITON_CAPABILITIES.kv_int8 and TRITON_CAPABILITIES.reads_kv(torch.float16, torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_quantizes_exactly_as_kv_quant(dtype: torch.dtype) -> None:
    """Values and scales equal ``quantize``'s bit for bit; other slots are left alone."""
    torch.manual_seed(0)
    x = (torch.randn(12, 3, 24) * 4).to(dtype)
    x[0, 0] = 0.0  # an all-zero head: scale 0, values 0
    x[1, 0, :4] = torch.tensor([127.0, 0.5, -2.5, 3.5])  # scale 1: ties, rounded to even
    x[2, 1, :3] = torch.tensor([127.0, 0.5 - 2**-11, 1e-3])  # just below a tie; a tiny value
    x[3, 2, 0] = -5.0e3 if dtype == torch.float32 else -6.0e4  # one large outlier
    slots = torch.randperm(39)[:12] + 1
    k_cache = torch.full((40, 3, 24), 99, dtype=torch.int8)
    v_cache, k_scale, v_scale = k_cache.clone(), torch.full((40, 3), -1.0), torch.full((40, 3), -1.0)
    store_kv(x, -x, k_cache, v_cache, slots, k_scale, v_scale)
    for cache, scales, values in ((k_cache, k_scale, x), (v_cache, v_scale, -x)):
        q, scale = quantize(values)
        assert torch.equal(cache[slots], q) and torch.equal(scales[slots], scale)
    assert k_cache[slots[1], 0, :4].tolist() == [127, 0, -2, 4] and k_scale[slots[0], 0] == 0.0
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert bool((k_cache[untouched] == 99).all()) and bool((v_scale[untouched] == -1.0).all())


def int8_storage(n_slots: int, n_kv: int, head_dim: int) -> KVStorage:
    """An int8 storage whose slots (but the zeroed slot 0) hold quantized random keys/values."""
    storage = KVStorage(2, n_slots, n_kv, head_dim, torch.int8, "cpu")
    for buffer, scales in ((storage.k_buffer, storage.k_scale), (storage.v_buffer, storage.v_scale)):
        q, s = quantize(torch.randn(2, n_slots - 1, n_kv, head_dim) * 2)
        buffer[:, 1:], scales[:, 1:] = q, s
    return storage


# (dtype, head_dim, GQA group, page_size, window); n_kv_heads = N_HEADS // group
CASES = [
    (torch.float32, 32, 2, 16, None),
    (torch.float16, 64, 4, 1, None),
    (torch.float32, 24, 1, 16, 5),  # head_dim not a power of two; a sliding window
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-g{c[2]}-p{c[3]}-w{c[4]}")
def test_prefill_then_decode_over_int8_match_torch(case: tuple) -> None:
    """Prefill (fresh, one-token extend, two q tiles over a 60-token prefix: keys across the 64-key
    chunk) and decode with one split and with several, against the reference on the same cache."""
    dtype, head_dim, group, page, window = case
    torch.manual_seed(head_dim)
    pair = CachePair(int8_storage, dtype, head_dim, group, page)
    rows = [pair.layout.new_row() for _ in range(3)]
    prefix, extend = [0, 5, 60], [7, 1, 10]
    pair.layout.extend_interleaved(rows, prefix)  # a cached prefix: int8 keys/values already stored
    assert pair.prefill(rows, prefix, extend, window) <= TOLERANCE[dtype]
    assert pair.decode(rows, min_tokens=64, window=window) <= TOLERANCE[dtype]  # lens 8, 7, 71: 1, 1, 2 splits
    assert pair.decode(rows, min_tokens=3, window=window) <= TOLERANCE[dtype]  # 3, 3 and 4 (capped) splits


def new_seq(tokens: list[int]) -> Sequence:
    return Sequence(prompt_token_ids=tokens, params=SamplingParams(max_tokens=8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-triton-int8")
    save_tiny_checkpoint(path, "llama")
    return path


def test_cuda_graph_static_decode_reads_the_scales(checkpoint: Path) -> None:
    """The runner's padded static decode view (run eagerly on CPU) over an int8 cache gives the
    eager decode's logits: it passes the scale tensors to the kernels."""
    assert static_decode_error(checkpoint, torch.int8) <= 1e-5


def test_engine_greedy_tokens_match_torch_backend_over_int8(checkpoint: Path) -> None:
    prompts = [list(range(3, 8)), [(7 * i) % 90 + 4 for i in range(19)], [(5 * i) % 80 + 6 for i in range(34)]]
    followup = prompts[2][:20] + [9, 8, 7]  # shares the first (cached) 16-token page of prompt 3
    options = dict(
        device="cpu",
        dtype="float32",
        kv_cache_dtype="int8",
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
            assert llm.engine.model.backend.name == backend and llm.engine.worker.storage.k_buffer.dtype == torch.int8
            first = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
            (second,) = llm.generate([followup], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
            stats = llm.engine.stats()
        finally:
            llm.shutdown()
        assert second.num_cached_tokens == 16
        assert stats["scheduler"]["chunked_prefills"] > 0 and stats["scheduler"]["mixed_steps"] > 0
        results[backend] = [o.outputs[0].token_ids for o in first] + [second.outputs[0].token_ids]
    assert results["triton"] == results["torch"]
