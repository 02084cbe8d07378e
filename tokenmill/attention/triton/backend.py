"""TritonBackend: KV store, split-KV paged decode and ragged paged prefill as Triton kernels.

Strict: every unsupported case raises at construction or in ``forward`` (attention logit
soft-capping included); nothing falls back to another implementation. An int8 KV cache
(``cache/kv_quant.py``) is quantized by the store kernel as it writes and read in place by the
attention kernels, with the scales of the view (``k_scale``/``v_scale``); an fp8 cache
(``cache/kv_fp8.py``, scale 1) is encoded by the store kernel and widened by the attention kernels,
as bytes (see ``store.py``). Sliding-window layers pass
their window to the kernels as a plain int argument (no device data). The decode path launches a
fixed grid from tensor shapes and never syncs with the host, and its plan is tensor ops into
buffers it owns, so a decode forward can be captured in a CUDA graph.

On CPU the kernels run only under Triton's interpreter, which is chosen when the kernels are
defined: ``TRITON_INTERPRET=1`` must be in the environment before this package is first
imported (tests only: it is slow, and ``tl.dot`` on bf16 is wrong there, so bf16 is refused).
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.triton.config import TritonConfig
from tokenmill.attention.triton.decode import decode_attention
from tokenmill.attention.triton.plan import (
    TritonDecodePlan,
    TritonGraphBuffers,
    TritonPlan,
    TritonPrefillPlan,
    prefill_tiles,
    split_counts,
)
from tokenmill.attention.triton.prefill import prefill_attention
from tokenmill.attention.triton.store import _store_kv_kernel, store_kv
from tokenmill.attention.triton_capabilities import TRITON_CAPABILITIES
from tokenmill.cache.views import DecodeKVCache, KVView

SUPPORTED_DTYPES = TRITON_CAPABILITIES.dtypes
MAX_HEAD_DIM = 256

INTERPRETED = isinstance(_store_kv_kernel, InterpretedFunction)
"""Whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""


class TritonBackend(AttentionBackend[TritonPlan]):
    """Triton kernels for CUDA tensors (or CPU tensors under the interpreter); any head_dim <= 256.

    Owns its split-KV decode scratch (``config.max_rows`` rows on ``device``); plans tile maps for
    prefill and split counts for decode (:mod:`tokenmill.attention.triton.plan`)."""

    name = "triton"
    capabilities = TRITON_CAPABILITIES

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        config: TritonConfig,
        device: torch.device | str,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(n_heads, n_kv_heads, head_dim, scale, softcap)  # refuses softcap (not implemented)
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"the triton attention backend supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}")
        device = torch.device(device)
        self._check_device(device)
        self.config = config
        rows, splits = config.max_rows, config.max_decode_splits
        self.partial_out = torch.zeros((rows, n_heads, splits, head_dim), dtype=torch.float32, device=device)
        self.partial_lse = torch.zeros((rows, n_heads, splits), dtype=torch.float32, device=device)

    def plan(self, view: KVView) -> TritonPlan:
        """Prefill: the tile map; decode: split counts (tensor ops only) and the scratch."""
        if isinstance(view, DecodeKVCache):
            self._check_rows(view.req_pool_indices.numel())
            cfg = self.config
            num_splits = split_counts(view.seq_lens, cfg.decode_split_min_tokens, cfg.max_decode_splits)
            return TritonDecodePlan(view, num_splits, self.partial_out, self.partial_lse)
        return prefill_tiles(view, self.config.prefill_q_tile)

    def graph_buffers(self, max_batch: int) -> TritonGraphBuffers:
        self._check_rows(max_batch)
        return TritonGraphBuffers(torch.ones(max_batch, dtype=torch.int32, device=self.partial_out.device))

    def plan_into(self, buffers: object, view: DecodeKVCache) -> TritonDecodePlan:
        assert isinstance(buffers, TritonGraphBuffers)
        num_splits = buffers.num_splits[: view.req_pool_indices.numel()]
        cfg = self.config
        num_splits.copy_(split_counts(view.seq_lens, cfg.decode_split_min_tokens, cfg.max_decode_splits))
        return TritonDecodePlan(view, num_splits, self.partial_out, self.partial_lse)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        plan: TritonPlan,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if not isinstance(plan, (TritonPrefillPlan, TritonDecodePlan)):
            raise ValueError(f"the triton backend attends with its own plan (plan(view)), got {type(plan).__name__}")
        view = plan.view
        self._check_fwd(q, k, v, layer_id, view, sliding_window)
        self._check_supported(q, view)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        k_cache = view.k_buffer[layer_id]
        v_cache = view.v_buffer[layer_id]
        quantized = view.k_scale is not None and view.v_scale is not None
        k_scale = view.k_scale[layer_id] if quantized else None
        v_scale = view.v_scale[layer_id] if quantized else None
        store_kv(k, v, k_cache, v_cache, view.out_cache_loc, k_scale, v_scale)
        if isinstance(plan, TritonDecodePlan):
            return decode_attention(q, k_cache, v_cache, plan, self.scale, sliding_window, k_scale, v_scale)
        return prefill_attention(q, k_cache, v_cache, plan, self.scale, sliding_window, k_scale, v_scale)

    def _check_rows(self, batch: int) -> None:
        if batch > self.config.max_rows:
            raise ValueError(f"a decode batch of {batch} exceeds the triton backend's max_rows {self.config.max_rows}")

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
        if view.k_buffer.dtype == torch.int8:
            if view.k_scale is None or view.v_scale is None:
                raise ValueError("an int8 KV cache needs its k_scale/v_scale in the view")
            if view.k_scale.stride() != view.v_scale.stride():
                raise ValueError("k_scale and v_scale must have the same strides")
