"""TritonBackend: KV store, split-KV paged decode and ragged paged prefill as Triton kernels.

Strict: every unsupported case raises at construction or in ``forward`` (attention logit
soft-capping included); nothing falls back to another implementation. Sliding-window layers pass
their window to the kernels as a plain int argument (no device data). The decode path launches a
fixed grid from tensor shapes and never syncs with the host, so a decode forward can be captured
in a CUDA graph.

On CPU the kernels run only under Triton's interpreter, which is chosen when the kernels are
defined: ``TRITON_INTERPRET=1`` must be in the environment before this package is first
imported (tests only: it is slow, and ``tl.dot`` on bf16 is wrong there, so bf16 is refused).
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.triton.decode import decode_attention
from tokenmill.attention.triton.prefill import prefill_attention
from tokenmill.attention.triton.store import _store_kv_kernel, store_kv
from tokenmill.cache.views import DecodeKVCache, KVView
from tokenmill.config import EngineConfig

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

INTERPRETED = isinstance(_store_kv_kernel, InterpretedFunction)
"""Whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""


class TritonBackend(AttentionBackend):
    """Triton kernels for CUDA tensors (or CPU tensors under the interpreter); any head_dim <= 256."""

    name = "triton"
    supports_cuda_graphs = True
    """Decode forwards are capturable: fixed grids, no host syncs, scratch from the view."""
    supports_sliding_window = True

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        config: EngineConfig,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(n_heads, n_kv_heads, head_dim, scale, softcap)  # refuses softcap (not implemented)
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"the triton attention backend supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}")
        self._check_device(config.resolved_device())

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_view: KVView,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        self._check_fwd(q, k, v, layer_id, kv_view, sliding_window)
        self._check_supported(q, kv_view)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        k_cache = kv_view.k_buffer[layer_id]
        v_cache = kv_view.v_buffer[layer_id]
        store_kv(k, v, k_cache, v_cache, kv_view.out_cache_loc)
        if isinstance(kv_view, DecodeKVCache):
            return decode_attention(q, k_cache, v_cache, kv_view, self.scale, sliding_window)
        return prefill_attention(q, k_cache, v_cache, kv_view, self.scale, sliding_window)

    @staticmethod
    def _check_device(device: torch.device) -> None:
        if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
            return
        if device.type == "cpu":
            raise RuntimeError(
                "the triton attention backend runs on CPU only under Triton's interpreter (tests): set "
                "TRITON_INTERPRET=1 before tokenmill.attention.triton is first imported, or use "
                "attention_backend='torch'"
            )
        raise RuntimeError(f"the triton attention backend needs a CUDA device, got {device}")

    def _check_supported(self, q: torch.Tensor, view: KVView) -> None:
        """Raise on what the kernels cannot do; shapes and dtypes only (no device sync)."""
        self._check_device(q.device)
        if q.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"the triton attention backend supports float32/float16/bfloat16, got {q.dtype}")
        if q.dtype == torch.bfloat16 and INTERPRETED:
            raise ValueError("bfloat16 is not supported under the Triton interpreter (tl.dot is wrong there)")
        if view.k_buffer.stride(-1) != 1 or view.v_buffer.stride(-1) != 1:
            raise ValueError("KV buffers must be contiguous in head_dim")
        if view.req_to_token.stride(-1) != 1:
            raise ValueError("req_to_token must be contiguous in its position dimension")
        if isinstance(view, DecodeKVCache):
            rows, heads, splits, dim = view.partial_out.shape
            batch = view.req_pool_indices.numel()
            if rows < batch or (heads, dim) != (self.n_heads, self.head_dim):
                raise ValueError(
                    f"partial_out {tuple(view.partial_out.shape)} must be [>= B={batch}, "
                    f"{self.n_heads}, max_splits, {self.head_dim}]"
                )
            if view.partial_lse.shape != (rows, heads, splits):
                raise ValueError(f"partial_lse {tuple(view.partial_lse.shape)} must be {(rows, heads, splits)}")
            if view.partial_out.dtype != torch.float32 or view.partial_lse.dtype != torch.float32:
                raise ValueError("partial_out / partial_lse must be float32")
            if view.partial_out.stride(-1) != 1 or view.partial_lse.stride(-1) != 1:
                raise ValueError("partial_out / partial_lse must be contiguous in their last dimension")
