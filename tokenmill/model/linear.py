"""Dense projections routed to the fastest kernel for the tensor's device.

On CPU, PyTorch's default ``F.linear`` calls MKL's sgemm, which is poor for the short,
wide products of decoding (few rows against a large weight): measured on a 2-core AVX2
machine over the ~100M benchmark model's weights, oneDNN's matmul (``mkldnn._linear_pointwise``,
the kernel ``torch.compile`` uses for CPU linears) is 1.6-1.9x faster for 1-64 rows and still
~1.06x faster for 2048-row prefill chunks. Elsewhere (GPU, non-fp32 dtypes, which oneDNN
refuses on CPUs without native bf16) ``F.linear`` is used.

The weight is read as stored, never re-packed, so in-place weight updates need no extra step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[..., in]`` and ``weight`` ``[out, in]`` (same as ``F.linear``)."""
    if _ONEDNN_AVAILABLE and x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward uses :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
