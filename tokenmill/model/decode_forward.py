"""The forward of a pure decode step as one C++ call (``kernels/cpu/decode_forward.cpp``).

:meth:`CpuDecodeForward.build` returns one only when the capability table allows it
(``capabilities.cpu_decode_forward_applies``: the backend's decode attention is the kernel's, the
family opted in, no soft-capping, one rank), the instance has nothing the kernel does not compute
(``CausalLM.cpu_decode_weights``) and the C++ kernels are available. It reads the neutral decode
view (such a backend plans nothing). The kernels and their order are those of the Python forward,
products included (each projection's blocked oneDNN weight where its ``Linear`` would use one for
the step's rows, a quantized projection's ``quantized_linear``, else the functional ``linear``'s
choice), so logits and stored keys/values are bit-identical to it. The caller (the engine's runner) decides per step:
:meth:`CpuDecodeForward.can_run`, then call it with the step's decode view.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.cache.kv_fp8 import FP8_DTYPES
from tokenmill.cache.views import DecodeKVCache
from tokenmill.kernels import linear as linear_kernels
from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.quant_linear import STREAM_MAX_ROWS
from tokenmill.model.capabilities import cpu_decode_forward_applies
from tokenmill.model.causal_lm import CausalLM, CpuDecodeWeights

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""Model dtypes of the kernel (its cache has the model's dtype, or is int8 or fp8: ``cache/kv_quant.py``,
``cache/kv_fp8.py``)."""
QUANTIZED_KV_DTYPES = (torch.int8, *FP8_DTYPES)
"""The KV dtypes the kernel stores and reads whatever the model's dtype."""


class CpuDecodeForward:
    """One model's decode forward through the C++ kernel, with its weights gathered once."""

    def __init__(
        self, weights: CpuDecodeWeights, kernel: Callable[..., torch.Tensor], scale: float, kv_dtype: torch.dtype
    ) -> None:
        self.weights = weights
        self._kernel = kernel
        self._scale = scale
        self._kv_dtype = kv_dtype
        quantized = [p if p is not None and p.quantization is not None else None for p in weights.projections]
        any_quantized = any(p is not None for p in quantized)
        self._qscales = [None if p is None else p.qscale for p in quantized] if any_quantized else []
        self._qmins = [None if p is None else p.qmin for p in quantized] if any_quantized else []
        # the int8 passes of the quantized projections' inputs (Linear.activation_passes: one setting per model)
        self.activation_passes = next((p.activation_passes for p in quantized if p is not None), 2)

    @classmethod
    def build(cls, model: CausalLM, backend: AttentionBackend, kv_dtype: torch.dtype) -> CpuDecodeForward | None:
        """The C++ decode forward of ``model`` attending like ``backend`` over a ``kv_dtype`` cache;
        None where not supported (the kernel stores and reads a cache in the model's dtype, fp32 or bf16,
        or an int8 or fp8 one)."""
        softcap = backend.softcap is not None
        applies = cpu_decode_forward_applies(backend.capabilities, model.capabilities, softcap, model.tp.size)
        if not applies or kv_dtype not in (*KERNEL_DTYPES, *QUANTIZED_KV_DTYPES):
            return None
        weights = model.cpu_decode_weights()
        if weights is None:
            return None
        ops = load_cpu_kernels()
        if ops is None:
            return None
        return cls(weights, ops.decode_forward, backend.scale, kv_dtype)

    def can_run(self, batch_size: int) -> bool:
        """Whether a decode step of ``batch_size`` requests fits the kernel: CPU weights in the cache's
        dtype (or an int8 or fp8 cache), and at least one request (at most ``PANEL_MAX_ROWS`` for fp32
        without blocked weights, beyond which the functional linear may need oneDNN)."""
        embed = self.weights.embed
        cache_fits = embed.dtype == self._kv_dtype or self._kv_dtype in QUANTIZED_KV_DTYPES
        if not embed.is_cpu or not cache_fits or batch_size < 1:
            return False
        plain_fp32 = embed.dtype == torch.float32 and torch.float32 not in linear_kernels.BLOCKED_MIN_ROWS
        return batch_size <= linear_kernels.PANEL_MAX_ROWS or not plain_fp32

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, view: DecodeKVCache) -> torch.Tensor:
        """Logits ``[B, vocab]`` of the decode step (every row), with its keys and values stored."""
        w = self.weights
        dtype = w.embed.dtype
        cos_table, sin_table = w.rotary.table(view.max_seq_len, dtype, w.embed.device)
        rows = input_ids.numel()
        blocked = [None if p is None else p.blocked_weight(dtype, rows) for p in w.projections]
        skinny_max_rows, panel_max_rows = linear_kernels.plain_row_limits(dtype)
        return self._kernel(
            input_ids,
            positions,
            w.embed,
            cos_table,
            sin_table,
            w.layers,
            blocked if any(b is not None for b in blocked) else [],
            w.final_norm,
            w.lm_head,
            view.k_buffer,
            view.v_buffer,
            view.out_cache_loc,
            view.req_to_token,
            view.req_pool_indices.contiguous(),
            view.seq_lens.contiguous(),
            w.windows,
            w.num_heads,
            w.num_kv_heads,
            w.head_dim,
            w.rms_norm_eps,
            self._scale,
            skinny_max_rows,
            panel_max_rows,
            self._qscales,
            self._qmins,
            STREAM_MAX_ROWS,
            view.k_scale,
            view.v_scale,
            self.activation_passes,
        )
