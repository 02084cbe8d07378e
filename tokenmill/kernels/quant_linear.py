"""Products with a weight kept quantized (:mod:`tokenmill.kernels.quant_format`).

On CPU with the C++ kernels built (fp32 or bf16 input), ``quantized_linear`` of ``quant_linear.cpp``:
- rows layout: up to ``STREAM_MAX_ROWS`` rows it streams the packed weight in fp32 (never
  dequantized whole), beyond it dequantizes the weight in the input's dtype a chunk of rows at a
  time into a buffer the thread keeps, for torch's BLAS; either way the result is
  ``x @ dequantize(weight).T + bias``, the contract of ``F.linear`` on the dequantized weight (to
  fp32 rounding: the kernel sums in its own order);
- panels layout (made only where :func:`int8_dot_products`), up to ``PANELS_MAX_ROWS`` rows: each
  row of x is first quantized per block of :func:`activation_block` values to the weight's
  ``activation_passes`` int8 passes, two by default: the value and its rounding residual
  (``quant_format.fake_quantize_activations``: to 1/508 of the block's int8 step; one pass: the
  value alone, to half a step, with half the integer work), and multiplied in integers
  (AVX512-VNNI, or, two passes, AMX-INT8 tiles from a few rows on where :func:`int8_dot_tiles`; on
  CPUs with AVX2 alone the two passes joined in int16: each row's result the same bits on any of
  them), streaming the packed weight: the result is
  ``F.linear`` of those dequantized activations on the dequantized weight (to fp32 rounding); more
  rows: the weight is dequantized into a temporary in the input's dtype for oneDNN, as above.
Elsewhere (GPU, other dtypes, no compiler) the weight is dequantized in torch for each call (and
the activations are not quantized).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.hardware import avx512, cpu_flags
from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.quant_format import GROUP_SIZES, QuantizedTensors, dequantize

STREAM_MAX_ROWS = 128 if "avx2" in cpu_flags() and not avx512() else 6
"""Most rows of x for which the rows layout's fp32 kernel streams the packed weight (more:
dequantize, then torch's BLAS); where the two cross over in docs/benchmarks.md's measurements: with AVX-512 the
kernel dequantizes each run into registers for each few rows, with AVX2 alone it dequantizes a
block of weight rows once into L1 for every row of x, and the BLAS's fp32 products are slower there."""


PANELS_MAX_ROWS = 192 if "amx_int8" in cpu_flags() else 512 if "avx512_vnni" in cpu_flags() else 2048
"""Most rows of x for which a panels-layout weight with two activation passes runs the int8 kernel
(its integer work doubles, and with many rows that work is the cost); more rows dequantize the
weight to x's dtype for oneDNN, which is faster beyond about this many rows (docs/benchmarks.md's
measurements): with AMX (int8 tiles for the kernel, bf16 tiles for oneDNN) from ~200 rows on, with
AVX-512 alone from ~512; with AVX2 alone (fp32 GEMM on the dequantized weight) not up to 2,048."""

ONE_PASS_PANELS_MAX_ROWS = 192 if "amx_int8" in cpu_flags() else 2048
"""The same limit for one activation pass: half the integer work, so with AVX512-VNNI or AVX2 the
kernel stays ahead of oneDNN up to 2,048 rows (docs/benchmarks.md); with AMX one pass runs the vector path,
not the tiles, and keeps the two-pass limit."""


def int8_dot_tiles() -> bool:
    """Whether the panels layout's int8 path multiplies with AMX-INT8 tiles from a few rows on."""
    kernels = load_cpu_kernels()
    return kernels is not None and bool(kernels.int8_dot_tiles())


def int8_dot_isa() -> str:
    """Which panels-layout int8 path the C++ kernels have: "avx512-vnni" (``quant_int8_dot.cpp``),
    "avx2" (``quant_int16_dot.cpp``, CPUs with AVX2 but not AVX512-VNNI: the same results, bit for
    bit), or "" (none, or no kernels)."""
    kernels = load_cpu_kernels()
    return "" if kernels is None else str(kernels.int8_dot_isa())


def int8_dot_products() -> bool:
    """Whether the C++ kernels have the panels layout's int8 path on this CPU (AVX512-VNNI or AVX2)."""
    return bool(int8_dot_isa())


def activation_block(group: int, in_features: int) -> int:
    """The block of a row of x sharing one int8 scale in the panels layout's products: the weight's
    group when it is at most 128, else the largest of 128, 64, 32 that divides K."""
    if group <= max(GROUP_SIZES):
        return group
    return next((b for b in reversed(GROUP_SIZES) if in_features % b == 0), in_features)


def quantized_linear(x: torch.Tensor, weight: QuantizedTensors, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` for the quantized ``W [N, K]``."""
    n, k = weight.shape
    if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16):
        kernels = load_cpu_kernels()
        if kernels is not None:
            rows = x.reshape(-1, k).contiguous()
            most_rows = PANELS_MAX_ROWS if weight.activation_passes == 2 else ONE_PASS_PANELS_MAX_ROWS
            if weight.panels and rows.shape[0] > most_rows:
                w = kernels.dequantize_weight(
                    weight.qweight, weight.scale, weight.min, weight.bits, weight.group, x.dtype
                )
                return F.linear(x, w, bias)
            out = kernels.quantized_linear(
                rows,
                weight.qweight,
                weight.scale,
                weight.min,
                weight.bits,
                weight.group,
                bias,
                STREAM_MAX_ROWS,
                weight.activation_passes,
            )
            return out.view(*x.shape[:-1], n)
    return F.linear(x, dequantize(weight, x.dtype), bias)
