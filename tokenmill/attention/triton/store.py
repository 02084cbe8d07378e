"""KV store kernel: ``k_cache[out_cache_loc[t]] = k[t]`` (and the same for v), one program per (token, kv head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=mask_d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=mask_d)
    tl.store(k_cache_ptr + slot * stride_kcs + h * stride_kch + offs_d, k, mask=mask_d)
    tl.store(v_cache_ptr + slot * stride_vcs + h * stride_vch + offs_d, v, mask=mask_d)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into one layer's caches ``[n_slots, Hkv, D]`` at ``out_cache_loc`` ``[T]``.

    Every tensor's last dimension must be contiguous.
    """
    n_tokens, n_kv_heads, head_dim = k.shape
    if n_tokens == 0:
        return
    _store_kv_kernel[(n_tokens, n_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        out_cache_loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )
