"""For the Triton quantized-cache tests (Triton's interpreter on CPU): CachePair, two copies of one
quantized KV cache (int8 or fp8), one read and written by the Triton backend, one by the torch
reference backend; and the CUDA-graph runner's static decode over such a cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.attention.helpers import PagedLayout
from tokenmill import SamplingParams
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.attention.triton import TritonBackend
from tokenmill.attention.triton.config import TritonConfig
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.storage import KVStorage, ReqToTokenPool
from tokenmill.cache.view_binder import ViewBinder
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view
from tokenmill.config import EngineConfig
from tokenmill.engine.sequence import Sequence
from tokenmill.model.loader import load_model
from tokenmill.worker.cuda_graphs import CudaGraphDecodeRunner

LAYER = 1  # of 2: exercises the per-layer buffer and scale offsets
N_HEADS = 4


def storage_parts(storage: KVStorage) -> dict[str, torch.Tensor]:
    """The storage's buffers (and an int8 cache's scales) as raw bytes."""
    names = ("k_buffer", "v_buffer", "k_scale", "v_scale")
    parts = {name: getattr(storage, name) for name in names}
    return {name: part.view(torch.uint8) for name, part in parts.items() if part is not None}


class CachePair:
    """Two copies of one cache made by ``make_storage(n_slots, n_kv_heads, head_dim)``: one for the
    Triton backend (``dtype`` queries), one for the torch reference (fp32 queries); every forward
    must leave their bytes equal."""

    def __init__(
        self,
        make_storage: Callable[[int, int, int], KVStorage],
        dtype: torch.dtype,
        head_dim: int,
        group: int,
        page_size: int,
    ) -> None:
        self.dtype, self.head_dim, self.n_kv = dtype, head_dim, N_HEADS // group
        self.layout = PagedLayout(page_size, n_pages=160 // page_size + 2, rows=4, context=96)
        self.storage = make_storage(self.layout.allocator.n_pages * page_size, self.n_kv, head_dim)
        self.ref = make_storage(self.storage.n_slots, self.n_kv, head_dim)
        theirs = storage_parts(self.ref)
        for name, part in storage_parts(self.storage).items():
            theirs[name].copy_(part)
        self.torch = TorchNativeBackend(N_HEADS, self.n_kv, head_dim)

    def triton(self, min_tokens: int = 64) -> TritonBackend:
        config = TritonConfig(prefill_q_tile=8, max_decode_splits=4, decode_split_min_tokens=min_tokens, max_rows=4)
        return TritonBackend(N_HEADS, self.n_kv, self.head_dim, config, "cpu")

    def qkv(self, n_tokens: int) -> tuple[torch.Tensor, ...]:
        shapes = ((n_tokens, N_HEADS), (n_tokens, self.n_kv), (n_tokens, self.n_kv))
        return tuple((torch.randn(*s, self.head_dim) * 2).to(self.dtype) for s in shapes)

    def run(self, make_view, qkv: tuple[torch.Tensor, ...], triton: TritonBackend, window: int | None) -> float:
        """Max |Triton - reference| of one forward (both within ``window``); checks both stores."""
        q, k, v = qkv
        out = triton.forward(q, k, v, LAYER, triton.plan(make_view(self.storage)), window)
        ref = self.torch.forward(q.float(), k.float(), v.float(), LAYER, make_view(self.ref), window)
        theirs = storage_parts(self.ref)
        for name, mine in storage_parts(self.storage).items():
            assert torch.equal(mine, theirs[name]), name
        assert out.dtype == self.dtype and out.shape == q.shape
        return (out.float() - ref).abs().max().item()

    def prefill(self, rows: list[int], prefix: list[int], extend: list[int], window: int | None = None) -> float:
        loc = torch.cat(self.layout.extend_interleaved(rows, extend))
        table = self.layout.pool.table
        view = lambda s: make_prefill_view(s, table, rows, prefix, extend, loc)  # noqa: E731
        return self.run(view, self.qkv(sum(extend)), self.triton(), window)

    def decode(self, rows: list[int], min_tokens: int, window: int | None = None) -> float:
        loc = torch.cat(self.layout.extend_interleaved(rows, [1] * len(rows)))
        seq_lens, table = [self.layout.lens[r] for r in rows], self.layout.pool.table
        view = lambda s: make_decode_view(s, table, rows, seq_lens, loc)  # noqa: E731
        return self.run(view, self.qkv(len(rows)), self.triton(min_tokens), window)


def static_decode_error(checkpoint: Path, kv_dtype: torch.dtype) -> float:
    """Max |logits| difference between the CUDA-graph runner's padded static decode view (run
    eagerly, on CPU) and the eager decode, for two requests of a Triton model over a ``kv_dtype`` cache."""
    model = load_model(checkpoint, torch.float32, "cpu")
    cfg = model.config
    config = EngineConfig(device="cpu", page_size=16, max_running_requests=4, cuda_graph_max_batch=4)
    storage = KVStorage(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim, kv_dtype, "cpu")
    pool = ReqToTokenPool(4, 64, "cpu")
    cache, views = CacheManager(config, storage.n_slots, pool), ViewBinder(storage, pool.table)
    triton_config = TritonConfig(prefill_q_tile=16, max_decode_splits=2, decode_split_min_tokens=8, max_rows=4)
    model.backend = TritonBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, triton_config, "cpu")
    seqs = [Sequence(prompt_token_ids=list(range(4, 4 + n)), params=SamplingParams(max_tokens=8)) for n in (3, 12)]
    for seq in seqs:
        assert cache.alloc(seq.kv, seq.all_token_ids)
    lens = [len(s.prompt_token_ids) for s in seqs]
    loc = torch.cat([cache.extend(s.kv, n) for s, n in zip(seqs, lens)])
    view = views.prefill([s.row for s in seqs], [0] * len(seqs), lens, loc)
    model(torch.tensor([t for s in seqs for t in s.prompt_token_ids]), torch.cat([torch.arange(n) for n in lens]), view)

    view = views.decode([s.row for s in seqs], [s.n_kv for s in seqs], cache.extend_decode([s.kv for s in seqs]))
    last, positions = torch.tensor([s.prompt_token_ids[-1] for s in seqs]), view.seq_lens - 1
    eager = model(last, positions, view)
    runner = CudaGraphDecodeRunner(model, storage, pool.table, config)
    runner._load(last, positions, view, 4)
    static = runner._forward(4, runner._plan(4))
    return (static[:2] - eager).abs().max().item()
