"""The int8 KV cache's format, and one layer's cache as the torch paths store and read it (an fp8
cache's too: ``cache/kv_fp8.py``).

int8 (``kv_cache_dtype="int8"``): each token's keys (and values) of one KV head are ``q * scale``
with ``q`` int8 in ``[-127, 127]`` and one fp32 ``scale = max|x| / 127`` (symmetric, round to
nearest; an all-zero head has scale 0). The scales sit beside the buffers in ``KVStorage``
(``k_scale`` / ``v_scale``, one per slot and head), so a slot is read in place: its int8 values
times its scale, never through a dequantized copy of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.cache.kv_fp8 import is_fp8, to_fp8
from tokenmill.cache.views import KVView

QMAX = 127.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (int8 values of the same shape, fp32 scales ``[...]``)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` (computed in fp32) as ``dtype``."""
    return (q.float() * scale[..., None]).to(dtype)


@dataclass(frozen=True)
class LayerKV:
    """One layer's keys and values ``[n_slots, n_kv_heads, head_dim]`` (and an int8 cache's scales).
    With ``kernels`` (the C++ CPU ops) an int8 cache is stored and read by ``kv_int8.cpp``, an fp8
    one by ``kv_fp8.cpp``, with the same results as the torch code here (which moves fp8 bytes as
    uint8: torch's CPU index ops have no fp8 kernels)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    kernels: Any = None

    @staticmethod
    def of(view: KVView, layer: int, kernels: Any = None) -> LayerKV:
        quantized = view.k_scale is not None and view.v_scale is not None
        return LayerKV(
            view.k_buffer[layer],
            view.v_buffer[layer],
            view.k_scale[layer] if quantized else None,
            view.v_scale[layer] if quantized else None,
            kernels,
        )

    @property
    def quantized(self) -> bool:
        """int8 or fp8: a read gives the stored (rounded) values, not those given, so attention reads them back."""
        return self.k_scale is not None or is_fp8(self.k.dtype)

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[T, n_kv_heads, head_dim]`` into ``slots`` ``[T]`` (int64), converted."""
        if is_fp8(self.k.dtype):
            if self.kernels is not None and k.dtype in (torch.float32, torch.bfloat16):
                self.kernels.store_kv_fp8_(k.contiguous(), v.contiguous(), self.k, self.v, slots)
                return
            for values, buffer in ((k, self.k), (v, self.v)):
                buffer.view(torch.uint8).index_copy_(0, slots, to_fp8(values, buffer.dtype).view(torch.uint8))
            return
        if self.k_scale is None or self.v_scale is None:
            # index_copy_: far faster than index_put on CPU
            self.k.index_copy_(0, slots, k.to(self.k.dtype))
            self.v.index_copy_(0, slots, v.to(self.v.dtype))
            return
        if self.kernels is not None and k.dtype in (torch.float32, torch.bfloat16):
            self.kernels.store_kv_int8_(
                k.contiguous(), v.contiguous(), self.k, self.v, self.k_scale, self.v_scale, slots
            )
            return
        for values, buffer, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = quantize(values)
            buffer.index_copy_(0, slots, q)
            scales.index_copy_(0, slots, scale)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of ``slots`` (int64, any shape ``S``) as ``dtype``: ``[*S, n_kv_heads, head_dim]``."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k.shape[1:])
        kernel, bf16 = self.kernels is not None and dtype in (torch.float32, torch.bfloat16), dtype == torch.bfloat16
        if is_fp8(self.k.dtype) and kernel:
            keys = self.kernels.read_kv_fp8(self.k, flat.contiguous(), bf16)
            values = self.kernels.read_kv_fp8(self.v, flat.contiguous(), bf16)
        elif is_fp8(self.k.dtype):
            keys, values = (b.view(torch.uint8).index_select(0, flat).view(b.dtype).to(dtype) for b in (self.k, self.v))
        elif self.k_scale is None or self.v_scale is None:
            keys, values = self.k.index_select(0, flat).to(dtype), self.v.index_select(0, flat).to(dtype)
        elif kernel:
            keys = self.kernels.read_kv_int8(self.k, self.k_scale, flat.contiguous(), bf16)
            values = self.kernels.read_kv_int8(self.v, self.v_scale, flat.contiguous(), bf16)
        else:
            keys = dequantize(self.k.index_select(0, flat), self.k_scale.index_select(0, flat), dtype)
            values = dequantize(self.v.index_select(0, flat), self.v_scale.index_select(0, flat), dtype)
        return keys.view(shape), values.view(shape)
