"""Products with a weight kept quantized (:mod:`tokenmill.kernels.quant_format`).

On CPU with the C++ kernels built (fp32 or bf16 input), ``quantized_linear`` of ``quant_linear.cpp``:
up to ``STREAM_MAX_ROWS`` rows it streams the packed weight once (never dequantized whole), beyond
it dequantizes the weight into a temporary in the input's dtype for oneDNN. Elsewhere (GPU, other
dtypes, no compiler) the weight is dequantized in torch for each call. Either way the result is
``x @ dequantize(weight).T + bias``, the contract of ``F.linear`` on the dequantized weight (to
fp32 rounding: the streamed path sums in fp32 in its own order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.quant_format import QuantizedTensors, dequantize

STREAM_MAX_ROWS = 6
"""Most rows of x for which the C++ kernel streams the packed weight (more: dequantize, then oneDNN);
where the two cross over in the README's measurements (576 x 3072 projections, bf16 input)."""


def quantized_linear(x: torch.Tensor, weight: QuantizedTensors, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` for the quantized ``W [N, K]``."""
    n, k = weight.shape
    if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16):
        kernels = load_cpu_kernels()
        if kernels is not None:
            rows = x.reshape(-1, k).contiguous()
            out = kernels.quantized_linear(
                rows, weight.qweight, weight.scale, weight.min, weight.bits, weight.group, bias, STREAM_MAX_ROWS
            )
            return out.view(*x.shape[:-1], n)
    return F.linear(x, dequantize(weight, x.dtype), bias)
