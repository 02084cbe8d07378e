"""Split-KV paged decode attention (flash-decoding): one query token per request.

Stage 1, grid ``(B, n_kv_heads, max_splits)``: program ``(b, g, s)`` attends the query heads of KV
head ``g`` (the whole GQA group, padded to a 16-row ``tl.dot`` tile) over split ``s`` of request
``b``'s visible keys — positions ``[f + s * L // n, f + (s + 1) * L // n)`` with ``f = max(0,
seq_lens[b] - window)`` (the last ``window`` keys; ``window`` a launch argument, the table width when
the layer has none), ``L = seq_lens[b] - f`` and ``n = num_splits[b]`` — reading K/V slot by slot
through ``req_to_token[req_pool_indices[b]]`` (an int8 cache's tiles dequantized in registers with
their scales, an fp8 cache's bytes widened there, see ``common.attend_kv_chunk``). It writes the
normalized partial output and its natural-log sum-exp to ``partial_out[b, h, s]`` and
``partial_lse[b, h, s]``. Programs with ``s >= n`` exit at once; an empty split writes ``lse =
-inf``. Stage 2, grid ``(B, n_heads)``: merges the ``n`` partials of each head.

The grid depends only on tensor shapes, and split bounds are read on the device, so a decode
step launches the same kernels whatever the lengths are (CUDA-graph capturable, no host sync).
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
from tokenmill.attention.triton.plan import TritonDecodePlan


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    req_to_token_ptr,
    req_pool_ptr,
    seq_lens_ptr,
    num_splits_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_ss,
    stride_sh,
    stride_rt,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    qk_scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.minimum(tl.load(num_splits_ptr + b), MAX_SPLITS)
    if split >= n_splits:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    first = tl.maximum(seq_len - window, 0)  # the last `window` keys
    n_keys = seq_len - first
    start = first + split * n_keys // n_splits
    end = first + (split + 1) * n_keys // n_splits
    table = req_to_token_ptr + tl.load(req_pool_ptr + b).to(tl.int64) * stride_rt

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_hd, other=0.0
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        slots = tl.load(table + pos, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = attend_kv_chunk(
            q,
            m_i,
            l_i,
            acc,
            slots,
            mask_n[None, :],
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

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    log2_lse = m_i + tl.log2(tl.where(nonempty, l_i, 1.0))  # scores were scaled by log2(e)
    lse = tl.where(nonempty, log2_lse * 0.6931471805599453, float("-inf"))  # natural log
    row_o = part_out_ptr + b.to(tl.int64) * stride_pob + split * stride_pos
    tl.store(row_o + heads[:, None] * stride_poh + offs_d[None, :], out, mask=mask_hd)
    tl.store(part_lse_ptr + b.to(tl.int64) * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


@triton.jit
def _decode_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    num_splits_ptr,
    o_ptr,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_splits = tl.minimum(tl.load(num_splits_ptr + b), MAX_SPLITS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_plb + h * stride_plh + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # empty splits (lse = -inf) weigh 0; the last split is never empty
    part = tl.load(
        part_out_ptr + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TritonDecodePlan,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` over each request's cached context (its last
    ``sliding_window`` keys when given); returns ``[B, H, D]``.

    ``k_cache``/``v_cache`` are one layer's ``[n_slots, Hkv, D]``; this step's k/v must already be
    stored; with ``k_scale``/``v_scale`` (``[n_slots, Hkv]`` fp32) they are int8, read in place (fp8
    ones, without scales, too).
    Uses ``plan.partial_out/partial_lse`` rows ``0..B-1`` as scratch.
    """
    batch, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[1]
    group = n_heads // n_kv_heads
    view = plan.view
    max_splits = plan.partial_out.shape[2]
    part_out, part_lse = plan.partial_out, plan.partial_lse
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_d = dot_block(head_dim)
    _decode_split_kernel[(batch, n_kv_heads, max_splits)](
        q,
        kernel_cache(k_cache),
        kernel_cache(v_cache),
        k_scale,
        v_scale,
        view.req_to_token,
        view.req_pool_indices,
        view.seq_lens,
        plan.num_splits,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        *scale_strides(k_scale),
        view.req_to_token.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        scale * LOG2E,
        kernel_window(sliding_window, view.req_to_token),
        GROUP=group,
        HEAD_DIM=head_dim,
        MAX_SPLITS=max_splits,
        BLOCK_H=dot_block(group),
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
        KV_FORMAT=kv_format(k_cache, k_scale),
        num_warps=4,
    )
    _decode_combine_kernel[(batch, n_heads)](
        part_out,
        part_lse,
        plan.num_splits,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        MAX_SPLITS=max_splits,
        BLOCK_S=triton.next_power_of_2(max_splits),
        BLOCK_D=block_d,
        num_warps=1,
    )
    return out
