"""Builds layer-3 views from a step's requests with tensor ops (no per-token Python loops)."""

from __future__ import annotations

import torch

from tokenmill.cache.storage import KVStorage
from tokenmill.cache.views import DecodeKVCache, PrefillKVCache


def indptr(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets ``[0, l0, l0+l1, ...]`` of consecutive segments of ``lengths`` (int64, ``len + 1``)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def make_prefill_view(
    storage: KVStorage,
    req_to_token: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    out_cache_loc: torch.Tensor,
) -> PrefillKVCache:
    """View for an extend step; ``out_cache_loc`` lists the new tokens' slots in batch order."""
    device = req_to_token.device
    extend = torch.tensor(extend_lens, dtype=torch.int64, device=device)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    return PrefillKVCache(
        k_buffer=storage.k_buffer,
        v_buffer=storage.v_buffer,
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=prefix + extend,
        prefix_lens=prefix,
        extend_lens=extend,
        qo_indptr=indptr(extend),
        out_cache_loc=out_cache_loc.to(device, torch.int64),
        max_seq_len=max(p + e for p, e in zip(prefix_lens, extend_lens)),
        extend_lens_cpu=list(extend_lens),
        prefix_lens_cpu=list(prefix_lens),
        k_scale=storage.k_scale,
        v_scale=storage.v_scale,
    )


def make_decode_view(
    storage: KVStorage,
    req_to_token: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    out_cache_loc: torch.Tensor,
) -> DecodeKVCache:
    """View for a pure decode step; ``seq_lens`` include this step's token."""
    device = req_to_token.device
    return DecodeKVCache(
        k_buffer=storage.k_buffer,
        v_buffer=storage.v_buffer,
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        out_cache_loc=out_cache_loc.to(device, torch.int64),
        max_seq_len=max(seq_lens),
        k_scale=storage.k_scale,
        v_scale=storage.v_scale,
    )
