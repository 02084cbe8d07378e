"""KV cache layer 3: phase-specific views handed to attention backends (pure data, no methods).

A view is built by the cache manager for exactly one forward and carries only what every backend
needs; a backend derives its own metadata (tiles, split counts, scratch) from it in its ``plan``.
Token tensors are laid out flat over the ragged batch: request ``i`` owns query rows
``qo_indptr[i]:qo_indptr[i+1]``. Host-side ints and lists (``max_seq_len``, ``*_cpu``) are carried
so that backends never need a device sync to size work.
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
    max_seq_len: int
    extend_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    k_scale: torch.Tensor | None = None  # [n_layers, n_slots, n_kv_heads] fp32: an int8 cache's scales
    v_scale: torch.Tensor | None = None


@dataclass
class DecodeKVCache:
    """A pure decode step: one query token per request, at position ``seq_lens[i] - 1``.

    Every tensor's shape depends on the batch size only, so a decode view over static tensors can
    be replayed in a CUDA graph (``max_seq_len`` is then an upper bound).
    """

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64 KV length including this step's token
    out_cache_loc: torch.Tensor  # [B] int64
    max_seq_len: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


KVView = PrefillKVCache | DecodeKVCache
