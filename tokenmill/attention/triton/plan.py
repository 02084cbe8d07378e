"""The Triton backend's per-forward metadata, planned from a neutral view.

Prefill: the ragged batch's query rows cut into tiles of ``q_tile`` rows (a tile never spans two
requests). Decode: the KV splits of each request (one per ``decode_split_min_tokens`` of context,
between 1 and ``max_decode_splits``), computed with tensor ops only (no host sync: a decode plan is
CUDA-graph capturable), and the backend's split-KV scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.cache.view_builder import indptr
from tokenmill.cache.views import DecodeKVCache, PrefillKVCache


@dataclass(frozen=True)
class TritonPrefillPlan:
    view: PrefillKVCache
    tile_req: torch.Tensor  # [n_tiles] int32 request of each Q tile
    tile_q_start: torch.Tensor  # [n_tiles] int32 first query row (within its request) of each tile
    q_tile: int  # query rows per tile


@dataclass(frozen=True)
class TritonDecodePlan:
    view: DecodeKVCache
    num_splits: torch.Tensor  # [B] int32 KV splits per request
    partial_out: torch.Tensor  # [max_rows, n_heads, max_splits, head_dim] fp32 scratch, rows 0..B-1 used
    partial_lse: torch.Tensor  # [max_rows, n_heads, max_splits] fp32 scratch


TritonPlan = TritonPrefillPlan | TritonDecodePlan


@dataclass(frozen=True)
class TritonGraphBuffers:
    """Static decode metadata of captured forwards: the split counts of up to ``max_batch`` rows."""

    num_splits: torch.Tensor  # [max_batch] int32


def prefill_tiles(view: PrefillKVCache, q_tile: int) -> TritonPrefillPlan:
    """Tile map of ``view``'s query rows (sized from its host-side extend lengths: no sync)."""
    device = view.extend_lens.device
    tiles_per_req = (view.extend_lens + q_tile - 1) // q_tile
    tile_offsets = indptr(tiles_per_req)
    n_tiles = sum((e + q_tile - 1) // q_tile for e in view.extend_lens_cpu)
    requests = torch.arange(len(view.extend_lens_cpu), device=device)
    tile_req = torch.repeat_interleave(requests, tiles_per_req, output_size=n_tiles)
    tile_q_start = (torch.arange(n_tiles, device=device) - tile_offsets[tile_req]) * q_tile
    return TritonPrefillPlan(view, tile_req.to(torch.int32), tile_q_start.to(torch.int32), q_tile)


def split_counts(seq_lens: torch.Tensor, min_tokens: int, max_splits: int) -> torch.Tensor:
    """KV splits per request: one per ``min_tokens`` of context, between 1 and ``max_splits``."""
    return torch.clamp((seq_lens + min_tokens - 1) // min_tokens, 1, max_splits).to(torch.int32)
