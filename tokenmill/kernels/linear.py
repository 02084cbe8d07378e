"""Dense projections routed to a kernel by the tensor's device, dtype and number of rows.

fp32 CPU products with at most ``SKINNY_MAX_ROWS`` rows use the C++ ``skinny_linear`` (a pure
weight stream), up to ``PANEL_MAX_ROWS`` the C++ ``panel_linear`` (register-tiled, weight packed
on the fly in L1-sized panels), larger ones oneDNN's matmul (``mkldnn._linear_pointwise``, the
kernel ``torch.compile`` uses for CPU linears). bf16 CPU products with at most
``SKINNY_MAX_ROWS_BF16`` rows use ``skinny_linear`` too (AVX512-BF16 dot products where the CPU has
them, else bf16 weights widened as they stream), larger ones ``F.linear`` (oneDNN; AMX tiles where
the CPU has them). Everything else (GPU; fp16) uses
``F.linear``. On CPUs where oneDNN is faster with its own weight layout (``BLOCKED_MIN_ROWS``:
bf16 with native bf16, fp32 on AVX-512), the :class:`Linear` module keeps a blocked copy of its
weight (see there); the functional :func:`linear` always reads the weight as stored. The thresholds
come from the timings in docs/benchmarks.md. Every path computes
``x @ weight.T + bias`` (same contract as ``F.linear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.hardware import avx512, avx512_bf16, native_bf16
from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.lora import LoRAWeights, add_lora
from tokenmill.kernels.quant_format import PANELS_INT8_GROUP, QuantizedTensors, QuantScheme, quantize, to_panels
from tokenmill.kernels.quant_linear import quantized_linear

SKINNY_MAX_ROWS = 8
SKINNY_MAX_ROWS_BF16 = 1
BLOCKED_BATCH_HINT = 64  # oneDNN picks the blocking for this many rows; it serves every row count
PANEL_MAX_ROWS = 128
_ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_BLOCKED_AVAILABLE = _ONEDNN_AVAILABLE and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
BLOCKED_MIN_ROWS: dict[torch.dtype, int] = {
    **({torch.bfloat16: 2 if avx512_bf16() else 1} if _BLOCKED_AVAILABLE and native_bf16() else {}),
    **({torch.float32: 2} if _BLOCKED_AVAILABLE and avx512() else {}),
}
"""dtypes whose projections use oneDNN with a blocked weight copy (where measured faster: bf16 on
CPUs with native bf16, fp32 on AVX-512), from how many rows (a single row streams faster through
``skinny_linear``: fp32, and bf16 where its AVX512-BF16 dot products are built)."""


def plain_row_limits(dtype: torch.dtype) -> tuple[int, int]:
    """``(skinny_max_rows, panel_max_rows)``: up to how many rows :func:`linear` takes ``skinny_linear``,
    then ``panel_linear``, for CPU ``dtype`` (fp32 or bf16) when the C++ kernels are built; beyond,
    oneDNN (fp32) or ``F.linear`` (bf16). The C++ decode forward picks its products by these."""
    if dtype == torch.bfloat16:
        return SKINNY_MAX_ROWS_BF16, SKINNY_MAX_ROWS_BF16
    return SKINNY_MAX_ROWS, PANEL_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[..., in]`` and ``weight`` ``[out, in]`` (same as ``F.linear``)."""
    if not (x.is_cpu and x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16)):
        return F.linear(x, weight, bias)
    rows = _n_rows(x)
    skinny_max_rows, panel_max_rows = plain_row_limits(x.dtype)
    if rows <= panel_max_rows and weight.is_contiguous():
        kernels = load_cpu_kernels()
        if kernels is not None:
            kernel = kernels.skinny_linear if rows <= skinny_max_rows else kernels.panel_linear
            return _on_rows(x, weight.shape[0], lambda rows_2d: kernel(rows_2d, weight, bias))
    if x.dtype == torch.float32 and _ONEDNN_AVAILABLE:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _n_rows(x: torch.Tensor) -> int:
    """Rows of ``x`` ``[..., in]`` seen as a 2-d ``[rows, in]`` operand."""
    return x.numel() // max(x.shape[-1], 1)


def _on_rows(x: torch.Tensor, out_features: int, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product`` of ``x`` as contiguous 2-d rows, shaped back to ``[..., out_features]``."""
    out = product(x.reshape(_n_rows(x), x.shape[-1]).contiguous())
    return out.view(*x.shape[:-1], out_features)


class BlockedCopy:
    """A copy of a CPU weight in oneDNN's blocked layout, for the products where it is faster
    (``BLOCKED_MIN_ROWS[dtype]`` rows or more), made on first use (or at start-up: :meth:`make_now`) and remade
    whenever the weight is not the one it was made from: another storage, dtype or shape
    (``Module.to``, ``weight.data = ...``) or an in-place change (its version counter moves:
    loading, weight updates). So the weight is not re-laid-out on every call; the copy doubles the
    weight's memory. One copy serves one weight (it may be a view, e.g. one expert's slice)."""

    def __init__(self) -> None:
        self._made: tuple[tuple, torch.Tensor] | None = None  # (what it was made from, blocked copy)

    def for_rows(self, weight: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor | None:
        """The blocked copy of ``weight`` for a CPU input of ``dtype`` and ``rows`` rows; None where
        :func:`linear` on the weight as stored is used instead, or for a weight without a version
        counter (created under ``torch.inference_mode``), whose changes could not be seen."""
        min_rows = BLOCKED_MIN_ROWS.get(dtype)
        if min_rows is None or weight.dtype != dtype or not weight.is_cpu or rows < min_rows:
            return None
        try:
            source = (weight.data_ptr(), weight.dtype, tuple(weight.shape), weight._version)
        except RuntimeError:
            return None
        if self._made is None or self._made[0] != source:
            self._made = (source, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BLOCKED_BATCH_HINT))
        return self._made[1]

    def make_now(self, weight: torch.Tensor) -> None:
        """Make the copy the products of ``weight`` with enough rows will use, now (at start-up),
        rather than on the first such product (a first request's cost); nothing where none is used."""
        min_rows = BLOCKED_MIN_ROWS.get(weight.dtype)
        if min_rows is not None:
            self.for_rows(weight, weight.dtype, min_rows)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, copy: BlockedCopy) -> torch.Tensor:
    """:func:`linear`, through ``copy``'s blocked weight where it applies to ``x``."""
    blocked = copy.for_rows(weight, x.dtype, _n_rows(x)) if x.is_cpu else None
    if blocked is None:
        return linear(x, weight, bias)
    pointwise = torch.ops.mkldnn._linear_pointwise
    return _on_rows(x, weight.shape[0], lambda rows_2d: pointwise(rows_2d, blocked, bias, "none", [], ""))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward uses :func:`linear`, through a
    :class:`BlockedCopy` of its weight for the dtypes in ``BLOCKED_MIN_ROWS``.

    :meth:`quantize_` (or :meth:`load_quantized_`, given the quantized tensors) replaces the ``weight``
    parameter by buffers holding it quantized (``qweight``, ``qscale``, ``qmin``; see
    ``quant_format``): from then on there is no ``weight``
    attribute, :attr:`quantization` names the scheme, and products go through :func:`quantized_linear`.

    With :attr:`lora` set (``model/lora.py``), a forward whose LoRA batch is bound adds each row's
    adapter delta to the product (:func:`~tokenmill.kernels.lora.add_lora`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._blocked = BlockedCopy()
        self.quantization: QuantScheme | None = None
        self.activation_passes = 2  # a panels-layout quantized weight's (QuantizedTensors.activation_passes)
        self.lora: LoRAWeights | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` with this layer's weight, quantized or not (plus the bound LoRA batch's
        deltas)."""
        if self.quantization is not None:
            out = quantized_linear(x, self.quantized_weight(), bias)
        else:
            out = blocked_linear(x, self.weight, bias, self._blocked)
        lora = self.lora
        if lora is not None and lora.binding.batch is not None:
            rows = _n_rows(x)
            add_lora(out.view(rows, out.shape[-1]), x.reshape(rows, x.shape[-1]).contiguous(), lora, lora.binding.batch)
        return out

    def quantize_(self, scheme: QuantScheme, panels: bool = False) -> None:
        """Keep the weight quantized with ``scheme`` from now on, in the rows layout or (``panels``)
        the panels layout (raises ValueError, changing nothing, if its shape does not fit the
        scheme's groups or the layout)."""
        if self.quantization is not None:
            raise ValueError(f"the layer is already quantized ({self.quantization.name})")
        self.load_quantized_(quantize(self.weight, scheme), scheme, panels)

    def load_quantized_(self, tensors: QuantizedTensors, scheme: QuantScheme, panels: bool = False) -> None:
        """Keep ``tensors`` (rows layout, already quantized with ``scheme``, e.g. repacked from a
        pre-quantized checkpoint) as this layer's weight from now on, in the rows layout or
        (``panels``) the panels layout: the ``weight`` parameter, if the layer still has one, is
        dropped. Raises ValueError, changing nothing, unless their shape is the layer's and fits the
        layout (groups of :data:`PANELS_INT8_GROUP` only in the panels layout)."""
        if tensors.shape != (self.out_features, self.in_features) or tensors.bits != scheme.bits:
            raise ValueError(
                f"int{tensors.bits} weight of shape {tensors.shape} does not fit a layer of "
                f"{(self.out_features, self.in_features)} quantized {scheme.name}"
            )
        if tensors.group == PANELS_INT8_GROUP and not panels:
            raise ValueError(f"groups of {PANELS_INT8_GROUP} are kept in the panels layout only")
        if panels:
            tensors = to_panels(tensors)
        if "weight" in self._parameters:
            del self.weight
        self._blocked = BlockedCopy()  # drops the blocked copy of the full-precision weight, if one was made
        self.register_buffer("qweight", tensors.qweight)
        self.register_buffer("qscale", tensors.scale)
        self.register_buffer("qmin", tensors.min)
        self.quantization = scheme

    def quantized_weight(self) -> QuantizedTensors:
        """The quantized weight's tensors (only after :meth:`quantize_`)."""
        assert self.quantization is not None, "the layer is not quantized"
        group = self.in_features * self.out_features // self.qscale.numel()
        return QuantizedTensors(
            self.qweight, self.qscale, self.qmin, self.quantization.bits, group, self.activation_passes
        )

    def make_blocked_copy(self) -> None:
        """Make the blocked copy of an unquantized weight now (:meth:`BlockedCopy.make_now`)."""
        if self.quantization is None:
            self._blocked.make_now(self.weight)

    def blocked_weight(self, dtype: torch.dtype, rows: int) -> torch.Tensor | None:
        """The blocked copy that :meth:`forward` multiplies a CPU input of ``dtype`` and ``rows`` rows
        by; None where it uses :func:`linear` on the weight as stored, or the weight is quantized."""
        return None if self.quantization is not None else self._blocked.for_rows(self.weight, dtype, rows)
