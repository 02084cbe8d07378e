"""Ragged paged prefill (extend) attention with a causal mask offset by each request's cached prefix.

Grid ``(n_tiles, n_heads)``: program ``(t, h)`` takes query rows
``tile_q_start[t] .. tile_q_start[t] + q_tile - 1`` (clipped to the request's extend length) of
request ``tile_req[t]`` for query head ``h``, padded to a ``BLOCK_M >= 16`` tile. Query row ``j``
sits at absolute position ``p = prefix_lens[r] + j`` and attends to positions ``k <= p`` with
``p - window < k`` (``window``: the layer's sliding window, or the table width when it has none),
read in ``BLOCK_N`` chunks through ``req_to_token[req_pool_indices[r]]`` (the cached prefix and
this step's tokens, which the store kernel has already written) from the first key the tile's first
row sees. Online softmax in fp32 (exp2); GQA by indexing KV head ``h // group``. An int8 cache's
tiles are dequantized in registers with their scales, an fp8 cache's bytes widened there
(``common.attend_kv_chunk``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.common import (
    BLOCK_N,
    LOG2E,
    attend_kv_chunk,
    dot_block,
    dot_precision,
    kernel_cache,
    kernel_window,
    kv_format,
    scale_strides,
)
from tokenmill.attention.triton.plan import TritonPrefillPlan


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    o_ptr,
    req_to_token_ptr,
    req_pool_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    qo_indptr_ptr,
    tile_req_ptr,
    tile_q_start_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_ss,
    stride_sh,
    stride_rt,
    qk_scale,
    q_tile,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    req = tl.load(tile_req_ptr + tile)
    q_start = tl.load(tile_q_start_ptr + tile)
    prefix = tl.load(prefix_lens_ptr + req).to(tl.int32)
    q_end = tl.minimum(q_start + q_tile, tl.load(extend_lens_ptr + req).to(tl.int32))
    first_row = tl.load(qo_indptr_ptr + req)
    table = req_to_token_ptr + tl.load(req_pool_ptr + req).to(tl.int64) * stride_rt

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_start + offs_m
    mask_m = q_idx < q_end
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix + q_idx
    rows = (first_row + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = prefix + q_end
    kv_start = tl.maximum(prefix + q_start - window + 1, 0)  # the first key the tile's first row sees
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < kv_end
        slots = tl.load(table + pos, mask=mask_n, other=0).to(tl.int64)
        # causal within the window (a row may see none of a chunk's keys: attend_kv_chunk skips it)
        visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_kv_chunk(
            q,
            m_i,
            l_i,
            acc,
            slots,
            visible,
            mask_n,
            offs_d,
            mask_d,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            kvh,
            stride_kcs,
            stride_kch,
            stride_vcs,
            stride_vch,
            stride_ss,
            stride_sh,
            qk_scale,
            DOT_PRECISION,
            KV_FORMAT,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only in padding rows (not stored)
    tl.store(
        o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TritonPrefillPlan,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the ragged ``q`` ``[T, H, D]`` over each request's prefix + new tokens
    (each query over its last ``sliding_window`` positions when given).

    ``k_cache``/``v_cache`` are one layer's ``[n_slots, Hkv, D]`` with this step's k/v already
    stored; with ``k_scale``/``v_scale`` (``[n_slots, Hkv]`` fp32) they are int8, read in place (fp8
    ones, without scales, too).
    Returns ``[T, H, D]`` in ``q``'s dtype.
    """
    n_tokens, n_heads, head_dim = q.shape
    view = plan.view
    n_tiles = plan.tile_req.numel()
    out = torch.empty_like(q)
    if n_tokens == 0 or n_tiles == 0:
        return out
    block_m = dot_block(plan.q_tile)
    _prefill_kernel[(n_tiles, n_heads)](
        q,
        kernel_cache(k_cache),
        kernel_cache(v_cache),
        k_scale,
        v_scale,
        out,
        view.req_to_token,
        view.req_pool_indices,
        view.prefix_lens,
        view.extend_lens,
        view.qo_indptr,
        plan.tile_req,
        plan.tile_q_start,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        *scale_strides(k_scale),
        view.req_to_token.stride(0),
        scale * LOG2E,
        plan.q_tile,
        kernel_window(sliding_window, view.req_to_token),
        GROUP=n_heads // k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=dot_block(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
        KV_FORMAT=kv_format(k_cache, k_scale),
        num_warps=8 if block_m >= 128 else 4,
    )
    return out
