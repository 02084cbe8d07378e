"""The forward of a pure decode step as one C++ call (``kernels/cpu/decode_forward.cpp``).

:meth:`CpuDecodeForward.build` returns one only when both sides allow it: the attention backend
(``supports_cpu_decode_forward``: the kernel's attention is that backend's) and the model
(``CausalLM.cpu_decode_weights``: its family opted in and the instance has nothing the kernel does
not compute), and when the C++ kernels are available. The kernels and their order are those of the
Python forward, so logits and stored keys/values are bit-identical to it. The caller (the engine's
runner) decides per step: :meth:`CpuDecodeForward.can_run`, then call it with the step's decode view.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.cache.views import DecodeKVCache
from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.linear import CPU_DECODE_MAX_ROWS, SKINNY_MAX_ROWS
from tokenmill.model.causal_lm import CausalLM, CpuDecodeWeights


class CpuDecodeForward:
    """One model's decode forward through the C++ kernel, with its weights gathered once."""

    def __init__(self, weights: CpuDecodeWeights, kernel: Callable[..., torch.Tensor], scale: float) -> None:
        self.weights = weights
        self._kernel = kernel
        self._scale = scale

    @classmethod
    def build(cls, model: CausalLM, backend: AttentionBackend, kv_dtype: torch.dtype) -> CpuDecodeForward | None:
        """The C++ decode forward of ``model`` attending like ``backend`` over a ``kv_dtype`` cache;
        None where not supported (the kernel stores and reads an fp32 cache)."""
        if not backend.supports_cpu_decode_forward or kv_dtype != torch.float32:
            return None
        weights = model.cpu_decode_weights()
        if weights is None:
            return None
        ops = load_cpu_kernels()
        if ops is None:
            return None
        return cls(weights, ops.decode_forward, backend.scale)

    def can_run(self, batch_size: int) -> bool:
        """Whether a decode step of ``batch_size`` requests fits the kernel (fp32 CPU weights, at
        most ``CPU_DECODE_MAX_ROWS`` requests: where its own linears beat the eager forward's)."""
        embed = self.weights.embed
        return 1 <= batch_size <= CPU_DECODE_MAX_ROWS and embed.is_cpu and embed.dtype == torch.float32

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, view: DecodeKVCache) -> torch.Tensor:
        """Logits ``[B, vocab]`` of the decode step (every row), with its keys and values stored."""
        w = self.weights
        cos_table, sin_table = w.rotary.table(view.max_seq_len, w.embed.dtype, w.embed.device)
        return self._kernel(
            input_ids,
            positions,
            w.embed,
            cos_table,
            sin_table,
            w.layers,
            w.final_norm,
            w.lm_head,
            view.k_buffer,
            view.v_buffer,
            view.out_cache_loc,
            view.req_to_token,
            view.req_pool_indices.contiguous(),
            view.seq_lens.contiguous(),
            w.num_heads,
            w.num_kv_heads,
            w.head_dim,
            w.rms_norm_eps,
            self._scale,
            SKINNY_MAX_ROWS,
        )
