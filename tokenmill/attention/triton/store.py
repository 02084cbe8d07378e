"""KV store kernel: ``k_cache[out_cache_loc[t]] = k[t]`` (and the same for v), one program per token
(all its KV heads: a ``[BLOCK_H, BLOCK_D]`` tile).

An int8 cache (``cache/kv_quant.py``) is quantized as it is written: per token and head ``scale =
max|x| / 127`` (0 for an all-zero head) and ``q = round_half_even(x / scale)`` clamped to
``[-127, 127]``, both divisions IEEE-rounded (``div_rn``), so values and scales equal
``kv_quant.quantize`` bit for bit.

An fp8 cache (``cache/kv_fp8.py``) is given as its bytes (``common.kernel_cache``) and each value is
encoded by integer ops on its fp32 bits (``_f32_to_fp8``: saturate, then round to nearest even), so
the bytes equal ``kv_fp8.to_fp8``'s in Triton's interpreter (whose own fp8 stores do not round as
torch does) and, by the same integer semantics, on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.common import (
    KV_FP8_E4M3,
    KV_FP8_E5M2,
    KV_INT8,
    kernel_cache,
    kv_format,
    scale_strides,
)

QMAX = 127.0


@triton.jit
def _round_half_even(y):
    """``y`` (fp32) rounded to the nearest integer, ties to even (``torch.round``); exact for ``|y| < 2**23``."""
    r = tl.floor(y)
    frac = y - r  # exact: the bits of y below its integer part
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _quantize_heads(x):
    """Values ``x`` ``[BLOCK_H, BLOCK_D]`` (fp32, masked lanes 0) -> (int8 values, fp32 scales ``[BLOCK_H]``)."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)
    safe = tl.where(scale > 0, scale, 1.0)
    q = _round_half_even(tl.math.div_rn(x, safe[:, None]))
    return tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int8), scale


@triton.jit
def _f32_to_fp8(x, E5M2: tl.constexpr):
    """fp32 ``x`` -> fp8 bytes (uint8; e5m2 or e4m3fn) of ``x`` clamped to the format's largest finite
    magnitude (57344 / 448; inf too), rounded to nearest even; NaN -> 0x7F with ``x``'s sign. torch's
    (c10's) conversion on the clamped value: normals round in the integer bits (add half an ulp less one,
    plus the kept mantissa's low bit); magnitudes below the smallest normal are aligned by an fp32 add
    of 2**7 / 2**14, which the FPU rounds to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    nan = a > 0x7F800000
    if E5M2:
        a = tl.minimum(a, 0x47600000)  # 57344
        small = (a.to(tl.float32, bitcast=True) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
        normal = (a - (112 << 23) + 0xFFFFF + ((a >> 21) & 1)) >> 21
        r = tl.where(a < (113 << 23), small, normal)
    else:
        a = tl.minimum(a, 0x43E00000)  # 448
        small = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
        r = tl.where(a < (121 << 23), small, normal)
    return (tl.where(nan, 0x7F, r) | sign).to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    loc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_ss,
    stride_sh,
    N_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = h < N_KV_HEADS
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if KV_FORMAT == KV_INT8:
        k, k_scale = _quantize_heads(k.to(tl.float32))
        v, v_scale = _quantize_heads(v.to(tl.float32))
        tl.store(k_scale_ptr + slot * stride_ss + h * stride_sh, k_scale, mask=mask_h)
        tl.store(v_scale_ptr + slot * stride_ss + h * stride_sh, v_scale, mask=mask_h)
    elif KV_FORMAT >= KV_FP8_E4M3:
        k = _f32_to_fp8(k.to(tl.float32), KV_FORMAT == KV_FP8_E5M2)
        v = _f32_to_fp8(v.to(tl.float32), KV_FORMAT == KV_FP8_E5M2)
    tl.store(k_cache_ptr + slot * stride_kcs + h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcs + h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into one layer's caches ``[n_slots, Hkv, D]`` at ``out_cache_loc`` ``[T]``;
    with ``k_scale``/``v_scale`` (``[n_slots, Hkv]`` fp32, equal strides) the caches are int8, quantized as written;
    fp8 caches (no scales) are written as ``kv_fp8.to_fp8`` does.

    Every tensor's last dimension must be contiguous.
    """
    n_tokens, n_kv_heads, head_dim = k.shape
    if n_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(n_kv_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(n_tokens,)](
        k,
        v,
        kernel_cache(k_cache),
        kernel_cache(v_cache),
        k_scale,
        v_scale,
        out_cache_loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        *scale_strides(k_scale),
        N_KV_HEADS=n_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        KV_FORMAT=kv_format(k_cache, k_scale),
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )
