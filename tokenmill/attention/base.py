"""AttentionBackend: the one interface every attention implementation provides.

Per forward, ``plan(view)`` runs once (before the first layer) and derives the backend's own
metadata from the neutral view (tile maps, split counts, scratch); a backend that needs none returns
the view itself, at no cost. Each layer then calls ``forward(q, k, v, layer_id, plan,
sliding_window)``, which stores this step's keys/values at ``view.out_cache_loc`` and returns the
attention output over each request's slots: a query at position ``p`` attends to its request's keys
at positions ``k <= p``, and ``p - sliding_window < k`` when the layer has a window (its model's
config chooses it per layer; None: global). Scores are ``q.k * scale`` (``scale``: ``head_dim **
-0.5`` unless the model gives its own), soft-capped to ``softcap * tanh(scores / softcap)`` before
the softmax when the backend is built with ``softcap``.
Shapes: ``q`` ``[T, n_heads, head_dim]``, ``k``/``v`` ``[T, n_kv_heads, head_dim]``, output like
``q``. ``T`` is the number of tokens in the flat ragged batch.

CUDA graphs (backends whose ``capabilities.cuda_graphs``): ``graph_buffers(max_batch)`` makes the
static metadata once; before capturing and before every replay the runner calls
``plan_into(buffers, view)`` on its static decode view, which writes the metadata into those buffers
(no host sync) and returns a plan over the same tensors every time.

What a backend supports is its ``capabilities`` (one row of the table in ``capabilities.py``);
combinations are checked once when an engine is built (``model/capabilities.py``). The base class
still refuses, per call, a window or KV dtype its backend cannot handle, and a soft-cap at
construction, so a backend built directly never computes something else silently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import torch

from tokenmill.attention.capabilities import BackendCapabilities
from tokenmill.cache.kv_fp8 import is_fp8
from tokenmill.cache.views import DecodeKVCache, KVView, PrefillKVCache

PlanT = TypeVar("PlanT")
"""A backend's planned metadata for one forward (the view itself for backends that need none)."""


class AttentionBackend(ABC, Generic[PlanT]):
    """Base class; subclasses declare ``name`` and ``capabilities``, own ``plan`` and ``forward``,
    and call ``_check_fwd`` first in ``forward``."""

    name: ClassVar[str] = "base"
    capabilities: ClassVar[BackendCapabilities]

    def __init__(
        self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float | None = None, softcap: float | None = None
    ) -> None:
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if softcap is not None:
            if not self.capabilities.softcap:
                raise ValueError(f"the {self.name} attention backend does not implement attention logit soft-capping")
            if softcap <= 0:
                raise ValueError(f"softcap must be > 0, got {softcap}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap

    @abstractmethod
    def plan(self, view: KVView) -> PlanT:
        """This backend's metadata for one forward over ``view``; called once per forward."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        plan: PlanT,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store k/v for this step's tokens, attend (within ``sliding_window`` keys, when given),
        return ``[T, n_heads, head_dim]``; ``plan`` is what ``plan(view)`` returned for this forward."""

    def graph_buffers(self, max_batch: int) -> object:
        """Static metadata for captured decode forwards of up to ``max_batch`` requests (made once;
        None: the plan holds no tensor of its own)."""
        return None

    def plan_into(self, buffers: object, view: DecodeKVCache) -> PlanT:
        """Plan the static decode ``view`` into ``buffers`` (from :meth:`graph_buffers`): the returned
        plan's tensors are the same on every call. This default suits a backend whose plan reads
        only the view's own tensors."""
        return self.plan(view)

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
            if not self.capabilities.sliding_window:
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
        if buffer.dtype == torch.int8 and not self.capabilities.kv_int8:
            raise ValueError(f"the {self.name} backend does not read an int8 KV cache")
        if is_fp8(buffer.dtype) and not self.capabilities.kv_fp8:
            raise ValueError(f"the {self.name} backend does not read an fp8 KV cache")
        quantized = buffer.dtype == torch.int8 or is_fp8(buffer.dtype)  # read per the flags above
        if buffer.dtype != q.dtype and not quantized and not self.capabilities.converts_kv_dtype:
            raise ValueError(f"the {self.name} backend needs a KV cache of q's dtype {q.dtype}, got {buffer.dtype}")
        if kv_view.out_cache_loc.numel() != n_tokens:
            raise ValueError(f"out_cache_loc has {kv_view.out_cache_loc.numel()} entries for {n_tokens} tokens")
        n_reqs = kv_view.req_pool_indices.numel()
        if isinstance(kv_view, DecodeKVCache) and n_tokens != n_reqs:
            raise ValueError(f"a decode view needs one token per request: {n_tokens} tokens, {n_reqs} requests")
        if isinstance(kv_view, PrefillKVCache) and sum(kv_view.extend_lens_cpu) != n_tokens:
            raise ValueError(f"prefill view covers {sum(kv_view.extend_lens_cpu)} tokens, got {n_tokens}")
