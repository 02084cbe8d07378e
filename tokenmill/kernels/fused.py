"""Fused decoder-layer ops: the C++ kernels (``tokenmill.kernels.cpu``) for fp32 and bf16 CPU
tensors, the torch code below (the reference they are tested against) for everything else.

Each function replaces a chain of torch ops (per-op overhead dominates a small model's CPU decode
step; intermediates' memory traffic a prefill chunk) and returns what its torch code returns: the
same values in fp32, and in bf16 values within one rounding of them (the kernels compute in fp32
and round each result once where torch rounds every intermediate op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu import load_cpu_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""CPU dtypes the C++ kernels take (bf16: fp32 math, each result rounded once)."""


def _kernels(x: torch.Tensor) -> Any | None:
    return load_cpu_kernels() if x.is_cpu and x.dtype in KERNEL_DTYPES else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32."""
    ops = _kernels(x)
    if ops is not None and x.dim() == 2 and weight.dtype == x.dtype:
        return ops.rms_norm(x.contiguous(), weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` and its rms_norm. The kernel updates ``residual`` in place and returns it;
    callers must own ``residual`` and use only the returned tensors afterwards."""
    ops = _kernels(x)
    if ops is not None and x.dim() == 2 and residual.is_contiguous() and x.dtype == residual.dtype == weight.dtype:
        return ops.add_rms_norm(x.contiguous(), residual, weight, eps), residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
    ops = _kernels(gate_up)
    if ops is not None and gate_up.dim() == 2:
        return ops.silu_and_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up = [gate | up]`` (GeGLU with transformers'
    ``gelu_pytorch_tanh``); torch ops on every device."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
}
"""config.json activation name -> ``act(gate) * up`` over ``[gate | up]``."""


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` in the rotate_half layout; ``cos``/``sin`` ``[T, R]``, ``R <= D``:
    only the first ``R`` dims of each head rotate (partial rotary), the rest pass through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_split_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fused q/k/v projection rows ``[T, (H + 2 Hkv) D]`` into contiguous ``q [T, H, D]``,
    ``k``/``v`` ``[T, Hkv, D]``, with RoPE applied to q and k (to their first ``cos.shape[-1]`` dims
    of each head, see :func:`apply_rotary`; the kernel rotates whole heads only)."""
    ops = _kernels(qkv)
    if ops is not None and cos.dtype == sin.dtype == qkv.dtype and cos.shape[-1] == head_dim:
        return ops.rotary_split_qkv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), n_heads, n_kv_heads, head_dim)
    n_tokens = qkv.shape[0]
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.view(n_tokens, n_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(n_tokens, n_kv_heads, head_dim), cos, sin)
    return q.contiguous(), k.contiguous(), v.reshape(n_tokens, n_kv_heads, head_dim).contiguous()
