"""KV cache layer 3: phase-specific views handed to attention backends (pure data, no methods).

A view is built by the cache manager for exactly one forward. Token tensors are laid out flat
over the ragged batch: request ``i`` owns query rows ``qo_indptr[i]:qo_indptr[i+1]``.
Host-side ints (``max_*``) are carried so that backends never need a device sync to size work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillKVCache:
    """An extend step: each request has its own cached-prefix length and ``q_len >= 1``.

    Query row ``j`` of request ``i`` sits at absolute position ``prefix_lens[i] + j`` and may
    attend to positions ``0 .. prefix_lens[i] + j`` of that request (causal, offset by the prefix).
    """

    k_buffer: torch.Tensor  # [n_layers, n_slots, n_kv_heads, head_dim]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [max_rows, max_context_len] int32
    req_pool_indices: torch.Tensor  # [B] int64 rows in req_to_token
    seq_lens: torch.Tensor  # [B] int64 KV length after this step (prefix + extend)
    prefix_lens: torch.Tensor  # [B] int64 tokens already in the cache before this step
    extend_lens: torch.Tensor  # [B] int64 query rows of each request this step
    qo_indptr: torch.Tensor  # [B + 1] int64 query-row offsets
    out_cache_loc: torch.Tensor  # [T] int64 slot where each new token's k/v are stored
    tile_req: torch.Tensor  # [n_tiles] int32 request of each Q tile
    tile_q_start: torch.Tensor  # [n_tiles] int32 first query row (within its request) of each tile
    q_tile: int  # query rows per tile
    max_seq_len: int
    extend_lens_cpu: list[int]
    prefix_lens_cpu: list[int]


@dataclass
class DecodeKVCache:
    """A pure decode step: one query token per request, at position ``seq_lens[i] - 1``.

    ``partial_out`` / ``partial_lse`` are preallocated split-KV scratch buffers (fixed shapes,
    so a decode step can be captured in a CUDA graph); only the first ``B`` rows are used.
    """

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64 KV length including this step's token
    out_cache_loc: torch.Tensor  # [B] int64
    num_splits: torch.Tensor  # [B] int32 KV splits per request for the split-KV kernel
    partial_out: torch.Tensor  # [max_rows, n_heads, max_splits, head_dim] fp32
    partial_lse: torch.Tensor  # [max_rows, n_heads, max_splits] fp32
    max_seq_len: int


KVView = PrefillKVCache | DecodeKVCache
