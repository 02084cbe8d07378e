"""Constants and launch helpers shared by the Triton attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_N = 64
"""KV positions per inner-loop chunk (decode and prefill)."""
MIN_DOT = 16
"""Smallest ``tl.dot`` tile dimension; smaller head groups / head dims / q tiles are padded to it."""


def dot_block(n: int) -> int:
    """Power-of-two ``tl.dot`` tile size covering ``n``."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def kernel_window(sliding_window: int | None, req_to_token: torch.Tensor) -> int:
    """The kernels' ``window`` argument: the layer's window, or (None, or wider than any context)
    the table width, which no context exceeds, so that ``p - window < 0 <= k`` for every key.
    A plain int from shapes and the layer's config: a decode launch stays CUDA-graph capturable."""
    width = req_to_token.shape[1]
    return width if sliding_window is None else min(sliding_window, width)


def scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """Slot and head strides of one layer's int8 scales ``[n_slots, Hkv]`` ((0, 0) without: unused)."""
    return (0, 0) if scale is None else (scale.stride(0), scale.stride(1))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 dots (matching the torch reference); 16-bit ones the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def attend_kv_chunk(
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
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """One online-softmax step of rows ``q`` ``[M, D]`` over the KV slots ``slots`` ``[N]`` of
    KV head ``kvh``; ``visible`` (broadcastable to ``[M, N]``) masks scores (a row that sees none
    of the chunk's keys is left unchanged). Scores are scaled by ``qk_scale`` (which includes
    log2(e)), so the running max ``m_i`` is in log2 units. ``QUANTIZED``: the caches are int8 with
    per-(slot, head) scales at ``k_scale_ptr``/``v_scale_ptr``, dequantized in registers: scores are
    ``(q . k_int8) * k_scale`` (the int8 values exact in ``q``'s dtype, summed in fp32) and the
    weights multiply ``v_int8 * v_scale`` (computed in fp32, then in ``q``'s dtype, as the torch
    path reads it). Returns the updated ``(m_i, l_i, acc)``."""
    k = tl.load(  # [BLOCK_D, BLOCK_N]: K^T straight from the cache
        k_cache_ptr + slots[None, :] * stride_kcs + kvh * stride_kch + offs_d[:, None],
        mask=mask_d[:, None] & mask_n[None, :],
        other=0.0,
    )
    if QUANTIZED:
        k_scale = tl.load(k_scale_ptr + slots * stride_ss + kvh * stride_sh, mask=mask_n, other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * (k_scale * qk_scale)[None, :]
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet (sliding window) keeps m = -inf: subtract 0 instead (no NaN)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr + slots[:, None] * stride_vcs + kvh * stride_vch + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    if QUANTIZED:
        v_scale = tl.load(v_scale_ptr + slots * stride_ss + kvh * stride_sh, mask=mask_n, other=0.0)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
