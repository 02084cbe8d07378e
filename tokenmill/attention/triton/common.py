"""Constants and launch helpers shared by the Triton attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.cache.kv_fp8 import is_fp8

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


KV_PLAIN = tl.constexpr(0)
KV_INT8 = tl.constexpr(1)
KV_FP8_E4M3 = tl.constexpr(2)
KV_FP8_E5M2 = tl.constexpr(3)
"""The kernels' ``KV_FORMAT``: the cache in the model's dtype, int8 with scales, fp8 e4m3fn or e5m2 bytes."""


def kv_format(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The ``KV_FORMAT`` of one layer's cache (int8 when it comes with scales)."""
    if scale is not None:
        return KV_INT8.value
    if cache.dtype == torch.float8_e4m3fn:
        return KV_FP8_E4M3.value
    return KV_FP8_E5M2.value if cache.dtype == torch.float8_e5m2 else KV_PLAIN.value


def kernel_cache(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels are given for ``cache``: an fp8 cache's bytes (a uint8 view of the same memory,
    decoded and encoded in the kernels, see ``fp8_to_f32``), any other cache as it is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """Slot and head strides of one layer's int8 scales ``[n_slots, Hkv]`` ((0, 0) without: unused)."""
    return (0, 0) if scale is None else (scale.stride(0), scale.stride(1))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 dots (matching the torch reference); 16-bit ones the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def fp8_to_f32(b, E5M2: tl.constexpr):
    """fp8 bytes ``b`` (uint8; e5m2 or e4m3fn) -> their values in fp32, exactly (inf, NaN included).

    Integer ops and bitcasts only, so the result is the same in Triton's interpreter (whose own fp8
    conversions get NaN/inf wrong) and on a GPU: an e5m2 byte is the high byte of an fp16; an e4m3fn
    byte's magnitude shifted into an fp16's bits is its value times 2**-8 (exponent bias 7 against
    15, subnormals included), and magnitude 0x7F is NaN."""
    b16 = b.to(tl.uint16)
    if E5M2:
        return (b16 << 8).to(tl.float16, bitcast=True).to(tl.float32)
    mag = b16 & 0x7F
    v = (((b16 & 0x80) << 8) | (mag << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where(mag == 0x7F, float("nan"), v)


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
    KV_FORMAT: tl.constexpr,
):
    """One online-softmax step of rows ``q`` ``[M, D]`` over the KV slots ``slots`` ``[N]`` of
    KV head ``kvh``; ``visible`` (broadcastable to ``[M, N]``) masks scores (a row that sees none
    of the chunk's keys is left unchanged). Scores are scaled by ``qk_scale`` (which includes
    log2(e)), so the running max ``m_i`` is in log2 units. ``KV_FORMAT`` ``KV_INT8``: the caches are
    int8 with per-(slot, head) scales at ``k_scale_ptr``/``v_scale_ptr``, dequantized in registers: scores are
    ``(q . k_int8) * k_scale`` (the int8 values exact in ``q``'s dtype, summed in fp32) and the
    weights multiply ``v_int8 * v_scale`` (computed in fp32, then in ``q``'s dtype, as the torch
    path reads it). ``KV_FP8_*``: the caches are fp8 bytes (scale 1, ``cache/kv_fp8.py``), widened in
    registers (``fp8_to_f32``, exact in ``q``'s dtype as the torch path reads them). Returns the updated
    ``(m_i, l_i, acc)``."""
    k = tl.load(  # [BLOCK_D, BLOCK_N]: K^T straight from the cache
        k_cache_ptr + slots[None, :] * stride_kcs + kvh * stride_kch + offs_d[:, None],
        mask=mask_d[:, None] & mask_n[None, :],
        other=0.0,
    )
    if KV_FORMAT == KV_INT8:
        k_scale = tl.load(k_scale_ptr + slots * stride_ss + kvh * stride_sh, mask=mask_n, other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * (k_scale * qk_scale)[None, :]
    elif KV_FORMAT >= KV_FP8_E4M3:
        k = fp8_to_f32(k, KV_FORMAT == KV_FP8_E5M2).to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
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
    if KV_FORMAT == KV_INT8:
        v_scale = tl.load(v_scale_ptr + slots * stride_ss + kvh * stride_sh, mask=mask_n, other=0.0)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    elif KV_FORMAT >= KV_FP8_E4M3:
        v = fp8_to_f32(v, KV_FORMAT == KV_FP8_E5M2).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
