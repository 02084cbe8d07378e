"""Builds layer-3 views from a step's requests with tensor ops (no per-token Python loops)."""

from __future__ import annotations

import torch

from tokenmill.cache.storage import KVStorage
from tokenmill.cache.views import DecodeKVCache, PrefillKVCache


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
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
    q_tile: int,
) -> PrefillKVCache:
    """View for an extend step; ``out_cache_loc`` lists the new tokens' slots in batch order."""
    device = req_to_token.device
    extend = torch.tensor(extend_lens, dtype=torch.int64, device=device)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    seq_lens = prefix + extend
    tiles_per_req = (extend + q_tile - 1) // q_tile
    tile_offsets = _indptr(tiles_per_req)
    n_tiles = int(sum((e + q_tile - 1) // q_tile for e in extend_lens))
    tile_req = torch.repeat_interleave(torch.arange(len(rows), device=device), tiles_per_req, output_size=n_tiles)
    tile_q_start = (torch.arange(n_tiles, device=device) - tile_offsets[tile_req]) * q_tile
    return PrefillKVCache(
        k_buffer=storage.k_buffer,
        v_buffer=storage.v_buffer,
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=seq_lens,
        prefix_lens=prefix,
        extend_lens=extend,
        qo_indptr=_indptr(extend),
        out_cache_loc=out_cache_loc.to(device, torch.int64),
        tile_req=tile_req.to(torch.int32),
        tile_q_start=tile_q_start.to(torch.int32),
        q_tile=q_tile,
        max_seq_len=max(p + e for p, e in zip(prefix_lens, extend_lens)),
        extend_lens_cpu=list(extend_lens),
        prefix_lens_cpu=list(prefix_lens),
    )


def decode_num_splits(seq_lens: torch.Tensor, min_tokens: int, max_splits: int) -> torch.Tensor:
    """KV splits per request: one per ``min_tokens`` of context, between 1 and ``max_splits``."""
    return torch.clamp((seq_lens + min_tokens - 1) // min_tokens, 1, max_splits).to(torch.int32)


def decode_scratch(
    rows: int, n_heads: int, splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode's fp32 partial outputs ``[rows, n_heads, splits, head_dim]`` and log-sum-exps
    ``[rows, n_heads, splits]``, made once and reused by every decode view."""
    partial_out = torch.zeros((rows, n_heads, splits, head_dim), dtype=torch.float32, device=device)
    return partial_out, torch.zeros((rows, n_heads, splits), dtype=torch.float32, device=device)


def make_decode_view(
    storage: KVStorage,
    req_to_token: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    out_cache_loc: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    split_min_tokens: int,
) -> DecodeKVCache:
    """View for a pure decode step; ``seq_lens`` include this step's token."""
    device = req_to_token.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    return DecodeKVCache(
        k_buffer=storage.k_buffer,
        v_buffer=storage.v_buffer,
        req_to_token=req_to_token,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=lens,
        out_cache_loc=out_cache_loc.to(device, torch.int64),
        num_splits=decode_num_splits(lens, split_min_tokens, partial_out.shape[2]),
        partial_out=partial_out,
        partial_lse=partial_lse,
        max_seq_len=max(seq_lens),
    )
