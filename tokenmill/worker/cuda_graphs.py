"""CUDA graphs for pure decode steps: capture the model's forward once per padded batch size.

A decode step of ``B`` requests runs in the graph of the smallest bucket ``bs >= B`` (1, 2, 4, 8,
... up to ``cuda_graph_max_batch``). Every tensor the captured forward reads lives in static
buffers: the runner holds the neutral view's (ids, positions, rows, lengths, slots) and the backend
its own metadata (``graph_buffers``). :meth:`CudaGraphDecodeRunner.run` copies the step into the
view's buffers, asks the backend to plan into its buffers (``plan_into``, outside the graph) and
replays.
Entries ``B .. bs-1`` are padding: token 0 at position 0 in request row 0 with one token of
context, storing its k/v in ``RESERVED_SLOT`` (never handed to a request), so they
read only valid slots and write nothing anyone reads. Sampling stays outside the graph.

Requirements: a CUDA device and a backend whose decode forward is capturable
(``capabilities.cuda_graphs``: fixed grid, no host sync, a static plan); weights updated in place (as
``apply_update`` does) stay valid, since the graphs hold the parameters' addresses.
"""

from __future__ import annotations

import time

import torch

from tokenmill.cache.storage import RESERVED_SLOT, KVStorage
from tokenmill.cache.views import DecodeKVCache
from tokenmill.config.runtime import RuntimeOptions
from tokenmill.model.causal_lm import CausalLM

PAD_ROW = 0
"""req_to_token row padded entries read (one position, any valid slot; their output is dropped)."""


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself."""
    buckets = []
    size = 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch]


def make_cuda_graph_runner(
    model: CausalLM, storage: KVStorage, table: torch.Tensor, config: RuntimeOptions
) -> CudaGraphDecodeRunner | None:
    """A runner when ``config.cuda_graphs`` is on, the KV storage lives on CUDA and the backend is capturable."""
    if not config.cuda_graphs or storage.k_buffer.device.type != "cuda":
        return None
    if model.backend is None or not model.backend.capabilities.cuda_graphs:
        return None
    return CudaGraphDecodeRunner(model, storage, table, config)


class CudaGraphDecodeRunner:
    """Lazily captured decode graphs per batch bucket, replayed with metadata copied in place.

    Worker thread only. ``run`` returns logits ``[B, vocab]`` that stay valid until the next
    ``run`` (they live in the graph's output buffer).
    """

    def __init__(self, model: CausalLM, storage: KVStorage, table: torch.Tensor, config: RuntimeOptions) -> None:
        self.model = model
        self.backend = model.backend
        self.storage = storage
        self.table = table  # [max_rows, max_context_len] int32 request-to-token table the graphs read
        device = storage.k_buffer.device
        self.max_batch = min(config.cuda_graph_max_batch, table.shape[0])
        if self.max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {config.cuda_graph_max_batch}")
        self.buckets = batch_buckets(self.max_batch)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full((n,), PAD_ROW, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((n,), RESERVED_SLOT, dtype=torch.int64, device=device)
        self.attention_buffers = self.backend.graph_buffers(n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds: dict[int, float] = {}
        self._pool: tuple | None = None

    def can_run(self, batch: int) -> bool:
        return 1 <= batch <= self.max_batch

    def bucket(self, batch: int) -> int:
        """Smallest captured size that holds ``batch`` requests."""
        return next(size for size in self.buckets if size >= batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, view: DecodeKVCache) -> torch.Tensor:
        """Logits ``[B, vocab]`` of the decode step ``view`` (capturing its bucket on first use)."""
        batch = input_ids.numel()
        size = self.bucket(batch)
        self._load(input_ids, positions, view, size)
        plan = self._plan(size)
        if size not in self.graphs:
            self._capture(size, plan)
        self.graphs[size].replay()
        return self.outputs[size][:batch]

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, view: DecodeKVCache, size: int) -> None:
        """Copy the step into the static buffers and reset entries ``B .. size-1`` to padding."""
        n = input_ids.numel()
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.req_pool_indices[:n].copy_(view.req_pool_indices)
        self.seq_lens[:n].copy_(view.seq_lens)
        self.out_cache_loc[:n].copy_(view.out_cache_loc)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.req_pool_indices[n:size].fill_(PAD_ROW)
            self.seq_lens[n:size].fill_(1)
            self.out_cache_loc[n:size].fill_(RESERVED_SLOT)

    def _view(self, size: int) -> DecodeKVCache:
        """The decode view over the first ``size`` static entries."""
        return DecodeKVCache(
            k_buffer=self.storage.k_buffer,
            v_buffer=self.storage.v_buffer,
            req_to_token=self.table,
            req_pool_indices=self.req_pool_indices[:size],
            seq_lens=self.seq_lens[:size],
            out_cache_loc=self.out_cache_loc[:size],
            max_seq_len=self.table.shape[1],  # an upper bound; capturable backends ignore it
            k_scale=self.storage.k_scale,  # an int8 cache's scales (None otherwise)
            v_scale=self.storage.v_scale,
        )

    def _plan(self, size: int) -> object:
        """The backend's plan of the static view of ``size`` entries, written into its static buffers."""
        return self.backend.plan_into(self.attention_buffers, self._view(size))

    def _forward(self, size: int, plan: object) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._view(size), attention_plan=plan)

    def _capture(self, size: int, plan: object) -> None:
        """Warm up (compiles kernels; rewrites this step's k/v with the same values), then capture."""
        started = time.perf_counter()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size, plan)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.outputs[size] = self._forward(size, plan)
        self._pool = graph.pool()
        self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds[size] = time.perf_counter() - started
