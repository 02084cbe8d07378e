"""AttentionBackend: the one interface every attention implementation provides.

``forward(q, k, v, layer_id, kv_view, sliding_window)`` stores this step's keys/values at
``kv_view.out_cache_loc`` and returns the attention output over each request's slots: a query at
position ``p`` attends to its request's keys at positions ``k <= p``, and ``p - sliding_window < k``
when the layer has a window (its model's config chooses it per layer; None: global). Scores are
``q.k * scale`` (``scale``: ``head_dim ** -0.5`` unless the model gives its own), soft-capped to
``softcap * tanh(scores / softcap)`` before the softmax when the backend is built with ``softcap``
(only a backend that ``supports_softcap``; the others refuse it at construction).
Shapes: ``q`` ``[T, n_heads, head_dim]``, ``k``/``v`` ``[T, n_kv_heads, head_dim]``, output like
``q``. ``T`` is the number of tokens in the flat ragged batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenmill.cache.views import DecodeKVCache, KVView, PrefillKVCache


class AttentionBackend(ABC):
    """Base class; subclasses own ``forward`` and call ``_check_fwd`` first."""

    name: str = "base"
    supports_cuda_graphs: bool = False
    """Decode forward capturable in a CUDA graph (fixed grid, no host sync)."""
    supports_cpu_decode_forward: bool = False
    """The C++ decode forward (``model/decode_forward.py``) computes exactly this backend's decode attention."""
    converts_kv_dtype: bool = False
    """The KV cache may hold another dtype than q/k/v (``kv_cache_dtype``): stored and read converted."""
    supports_sliding_window: bool = False
    """``forward`` applies a ``sliding_window``; a backend without it refuses windowed layers."""
    supports_softcap: bool = False
    """Attention logit soft-capping (``softcap``); a backend without it refuses to be built with one."""

    def __init__(
        self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float | None = None, softcap: float | None = None
    ) -> None:
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if softcap is not None:
            if not self.supports_softcap:
                raise ValueError(f"the {self.name} attention backend does not implement attention logit soft-capping")
            if softcap <= 0:
                raise ValueError(f"softcap must be > 0, got {softcap}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_view: KVView,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store k/v for this step's tokens, attend (within ``sliding_window`` keys, when given),
        return ``[T, n_heads, head_dim]``."""

    def _check_fwd(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_view: KVView,
        sliding_window: int | None = None,
    ) -> None:
        """Raise ValueError on any mismatch between the tensors, the view and this backend."""
        if sliding_window is not None:
            if not self.supports_sliding_window:
                raise ValueError(f"the {self.name} attention backend does not implement sliding-window attention")
            if sliding_window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if not isinstance(kv_view, (PrefillKVCache, DecodeKVCache)):
            raise ValueError(f"kv_view must be PrefillKVCache or DecodeKVCache, got {type(kv_view).__name__}")
        n_tokens = q.shape[0]
        if q.dim() != 3 or q.shape[1:] != (self.n_heads, self.head_dim):
            raise ValueError(f"q must be [T, {self.n_heads}, {self.head_dim}], got {tuple(q.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.shape != (n_tokens, self.n_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must be [{n_tokens}, {self.n_kv_heads}, {self.head_dim}], got {tuple(t.shape)}"
                )
        buffer = kv_view.k_buffer
        if not 0 <= layer_id < buffer.shape[0]:
            raise ValueError(f"layer_id {layer_id} out of range [0, {buffer.shape[0]})")
        if buffer.shape[2:] != (self.n_kv_heads, self.head_dim):
            raise ValueError(f"KV buffer heads/dim {tuple(buffer.shape[2:])} do not match the backend's")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} must be equal")
        if buffer.dtype != q.dtype and not self.converts_kv_dtype:
            raise ValueError(f"the {self.name} backend needs a KV cache of q's dtype {q.dtype}, got {buffer.dtype}")
        if kv_view.out_cache_loc.numel() != n_tokens:
            raise ValueError(f"out_cache_loc has {kv_view.out_cache_loc.numel()} entries for {n_tokens} tokens")
        n_reqs = kv_view.req_pool_indices.numel()
        if isinstance(kv_view, DecodeKVCache) and n_tokens != n_reqs:
            raise ValueError(f"a decode view needs one token per request: {n_tokens} tokens, {n_reqs} requests")
        if isinstance(kv_view, PrefillKVCache) and sum(kv_view.extend_lens_cpu) != n_tokens:
            raise ValueError(f"prefill view covers {sum(kv_view.extend_lens_cpu)} tokens, got {n_tokens}")
