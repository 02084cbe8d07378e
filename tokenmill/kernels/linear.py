"""Dense projections routed to a kernel by the tensor's device, dtype and number of rows.

fp32 CPU products with at most ``SKINNY_MAX_ROWS`` rows use the C++ ``skinny_linear`` (a pure
weight stream), up to ``PANEL_MAX_ROWS`` the C++ ``panel_linear`` (register-tiled, weight packed
on the fly in L1-sized panels), larger ones oneDNN's matmul (``mkldnn._linear_pointwise``, the
kernel ``torch.compile`` uses for CPU linears). Everything else (GPU; bf16/fp16) uses
``F.linear``. The thresholds come from the per-row-count timings in the README's performance
section. Weights are read as stored, never re-packed ahead of time, so in-place weight updates
need no extra step. Every path computes ``x @ weight.T + bias`` (same contract as ``F.linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.cpu import load_cpu_kernels

SKINNY_MAX_ROWS = 8
PANEL_MAX_ROWS = 128
_ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[..., in]`` and ``weight`` ``[out, in]`` (same as ``F.linear``)."""
    if not (x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32):
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= PANEL_MAX_ROWS and weight.is_contiguous():
        kernels = load_cpu_kernels()
        if kernels is not None:
            kernel = kernels.skinny_linear if rows <= SKINNY_MAX_ROWS else kernels.panel_linear
            out = kernel(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
            return out.view(*x.shape[:-1], weight.shape[0])
    if _ONEDNN_AVAILABLE:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward uses :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
