"""The in-memory format of weights kept quantized: int8 and int4, weight-only, grouped along K.

A weight ``W [N, K]`` becomes, per group of ``group_size`` consecutive values of a row (a multiple
of 32 that divides K; ``group_size = K`` is one scale per output channel; int8 in the panels layout
may also have groups of 16, :data:`PANELS_INT8_GROUP`):

- int8, symmetric: ``qweight`` int8 ``[N, K]``, ``W ~= q * scale`` with ``q`` in -127..127;
- int4: ``qweight`` uint8 ``[N, K / 2]``, ``W ~= q * scale + min`` with ``q`` in 0..15 (asymmetric:
  ``min`` is the group's smallest value; symmetric: ``min = -8 * scale`` with ``scale = absmax / 7``,
  so q - 8 is in -7..7 and zero is exact). Each run of 32 values along K is 16 bytes: value ``j``
  in byte ``j``'s low nibble, value ``16 + j`` in its high one (the kernels unpack a run into two
  16-wide vectors).

``scale`` and ``min`` are fp32 ``[N, K / group_size]``. Checkpoint formats (AWQ, GPTQ, GGUF) are
repacked into this one at load. Quantizing here is round-to-nearest, with scales and mins rounded
to fp16 numbers first (where all are finite there), as GGUF's blocks keep theirs.

That is the *rows* layout. The *panels* layout (:func:`to_panels`; needs N a multiple of 16) holds
the same values for the int8-activation kernel: ``qweight`` 3-D ``[N / 16, K / 4, 64 | 32]``, per
panel of 16 rows and quad of 4 values along K the 64 bytes of one 16-lane int32 vector (lane ``r``:
row ``r``'s 4 values; int4 quads in pairs, 32 bytes a quad: the 64 bytes of quads ``2 j`` and
``2 j + 1`` hold quad ``2 j``'s 64 values in their low nibbles and quad ``2 j + 1``'s in their high
ones, so one 64-byte load and a mask or a shift give either as a vector), and ``scale``/``min``
``[N / 16, K / group_size, 16]`` (a panel's scales, group after group, one stream beside its weights)
in fp16 where every scale and min is exactly an fp16 number (a GGUF Q8_0/Q5_0/Q4_0/Q4_1 weight's,
whose file stores them so), else in fp32: the same values either way, in fewer bytes to stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RUN = 32
"""Values per packed int4 run; every group size is a multiple of it."""
PANEL = 16
"""Weight rows per panel of the panels layout."""
GROUP_SIZES = (32, 64, 128)
PANELS_INT8_GROUP = 16
"""A group size only int8 weights in the panels layout have (a GGUF Q6_K sub-block: the rows
layout's kernels read whole runs of 32)."""


@dataclass(frozen=True)
class QuantScheme:
    """How a weight is quantized: ``bits`` 8 or 4, ``group_size`` (None: int8 has one group per output
    channel, i.e. the whole row; int4 the largest of 128, 64, 32 that divides the layer's K; int8
    may have :data:`PANELS_INT8_GROUP`, panels layout only), ``symmetric`` (int8 always is)."""

    bits: int
    group_size: int | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"quantized weights have 8 or 4 bits, not {self.bits}")
        allowed = (*GROUP_SIZES, PANELS_INT8_GROUP) if self.bits == 8 else GROUP_SIZES
        if self.group_size is not None and self.group_size not in allowed:
            raise ValueError(f"group size must be one of {allowed} or None (per channel), not {self.group_size}")
        if self.bits == 8 and not self.symmetric:
            raise ValueError("int8 weights are symmetric")

    def group_for(self, in_features: int) -> int:
        """The group length along K for a weight of ``in_features`` columns (raises if it does not divide)."""
        if self.group_size is None and self.bits == 4:
            group = next((g for g in reversed(GROUP_SIZES) if in_features % g == 0), RUN)
        else:
            group = self.group_size or in_features
        if in_features % group or (group % RUN and group != PANELS_INT8_GROUP):
            raise ValueError(
                f"a weight with {in_features} input features cannot be quantized in groups of {group} "
                f"(the group must divide K and be a multiple of {RUN})"
            )
        return group

    @property
    def name(self) -> str:
        groups = f"g{self.group_size}" if self.group_size else "per-channel" if self.bits == 8 else "g-auto"
        return f"int{self.bits}-{groups}" + ("" if self.bits == 8 else "-sym" if self.symmetric else "-asym")


@dataclass
class QuantizedTensors:
    """One quantized weight in the rows or the panels layout (see the module docstring): ``min`` is
    None for int8. ``activation_passes``: how many int8 passes the panels layout's products quantize
    their inputs to (:func:`fake_quantize_activations`)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    bits: int
    group: int
    activation_passes: int = 2

    @property
    def panels(self) -> bool:
        return self.qweight.dim() == 3

    @property
    def shape(self) -> tuple[int, int]:
        if self.panels:
            panels, quads, _ = self.qweight.shape
            return panels * PANEL, quads * 4
        n, packed = self.qweight.shape
        return n, packed if self.bits == 8 else 2 * packed


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedTensors:
    """``weight [N, K]`` (any float dtype) quantized round-to-nearest, computed in fp32."""
    n, k = weight.shape
    group = scheme.group_for(k)
    w = weight.detach().float().reshape(n, k // group, group)
    if scheme.bits == 8:
        scale = _fp16_where_finite(w.abs().amax(dim=-1) / 127.0)
        q = torch.round(w / _nonzero(scale)[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedTensors(q.reshape(n, k).contiguous(), scale.contiguous(), None, 8, group)
    if scheme.symmetric:
        scale = _fp16_where_finite(w.abs().amax(dim=-1) / 7.0)
        low = -8.0 * scale
    else:
        low = _fp16_where_finite(w.amin(dim=-1))
        scale = _fp16_where_finite((w.amax(dim=-1) - low) / 15.0)
    q = torch.round((w - low[..., None]) / _nonzero(scale)[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedTensors(pack_int4(q.reshape(n, k)), scale.contiguous(), low.contiguous(), 4, group)


def dequantize(tensors: QuantizedTensors, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``[N, K]`` the quantized tensors stand for, in ``dtype`` (computed in fp32)."""
    if tensors.panels:
        tensors = from_panels(tensors)
    n, k = tensors.shape
    groups = k // tensors.group
    if tensors.bits == 8:
        w = tensors.qweight.float().reshape(n, groups, tensors.group) * tensors.scale[..., None]
    else:
        assert tensors.min is not None
        q = unpack_int4(tensors.qweight).float().reshape(n, groups, tensors.group)
        w = q * tensors.scale[..., None] + tensors.min[..., None]
    return w.reshape(n, k).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 ``[N, K]`` (K a multiple of 32) packed two to a byte, run by run."""
    n, k = q.shape
    runs = q.reshape(n, k // RUN, 2, RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 ``[N, K]`` with values 0..15."""
    n, half = packed.shape
    runs = packed.reshape(n, half // (RUN // 2), 1, RUN // 2)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(n, 2 * half)


ACTIVATION_RESIDUAL_STEPS = 254
"""The panels kernel's second int8 pass counts the first pass's rounding residual in this many
parts of its step (the residual is at most half a step, so it fits in [-127, 127])."""


def fake_quantize_activations(x: torch.Tensor, block: int, passes: int = 2) -> torch.Tensor:
    """``x [..., K]`` (float) as the panels layout's kernel sees it, in fp32: each block of ``block``
    values of a row has the step ``s = absmax / 127`` and two int8 passes, ``hi = round(x / s)`` and
    ``lo = round((x - hi s) / (s / 254))`` (``torch.round``: half to even), dequantized as
    ``hi s + lo s / 254``; with one pass (``passes=1``, llama.cpp's int8 activations), ``hi s``."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    step = _nonzero(scale)
    hi = torch.round(blocks / step)
    if passes == 1:
        return (hi * scale).reshape(x.shape)
    fine = step / ACTIVATION_RESIDUAL_STEPS
    lo = torch.round(torch.addcmul(blocks, hi, step, value=-1) / fine)
    return (hi * scale + lo * (scale / ACTIVATION_RESIDUAL_STEPS)).reshape(x.shape)


def to_panels(tensors: QuantizedTensors) -> QuantizedTensors:
    """The same weight (rows layout) in the panels layout; raises ValueError unless N is a multiple of 16."""
    n, k = tensors.shape
    if n % PANEL:
        raise ValueError(f"the panels layout needs a multiple of {PANEL} output rows, not {n}")
    values = tensors.qweight if tensors.bits == 8 else unpack_int4(tensors.qweight)
    quads = values.reshape(n // PANEL, PANEL, k // 4, 4).transpose(1, 2)  # [panel, quad, lane, 4]
    if tensors.bits == 4:
        pairs = quads.reshape(n // PANEL, k // 8, 2, 4 * PANEL)
        quads = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    scale, low = tensors.scale, tensors.min
    if _exact_in_fp16(scale) and (low is None or _exact_in_fp16(low)):
        scale, low = scale.half(), None if low is None else low.half()
    return QuantizedTensors(
        quads.reshape(n // PANEL, k // 4, -1).contiguous(),
        _panel_major(scale),
        None if low is None else _panel_major(low),
        tensors.bits,
        tensors.group,
    )


def from_panels(tensors: QuantizedTensors) -> QuantizedTensors:
    """The inverse of :func:`to_panels`."""
    n, k = tensors.shape
    quads = tensors.qweight
    if tensors.bits == 4:
        pairs = quads.reshape(n // PANEL, k // 8, 1, 4 * PANEL)
        quads = torch.cat([pairs & 15, pairs >> 4], dim=2)
    values = quads.reshape(n // PANEL, k // 4, PANEL, 4).transpose(1, 2).reshape(n, k)
    return QuantizedTensors(
        values.contiguous() if tensors.bits == 8 else pack_int4(values),
        _row_major(tensors.scale.float()),
        None if tensors.min is None else _row_major(tensors.min.float()),
        tensors.bits,
        tensors.group,
    )


def _panel_major(per_row: torch.Tensor) -> torch.Tensor:
    """Scales ``[N, G]`` as the panels layout keeps them: ``[N / 16, G, 16]``."""
    n, groups = per_row.shape
    return per_row.reshape(n // PANEL, PANEL, groups).transpose(1, 2).contiguous()


def _row_major(per_panel: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_panel_major`."""
    panels, groups, _ = per_panel.shape
    return per_panel.transpose(1, 2).reshape(panels * PANEL, groups).contiguous()


def _exact_in_fp16(values: torch.Tensor) -> bool:
    """Whether every one of the fp32 ``values`` is an fp16 number (finite, no precision lost)."""
    return bool(torch.equal(values.half().float(), values))


def _fp16_where_finite(values: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` rounded to fp16 numbers (so that the panels layout streams them in half the
    bytes, as GGUF's blocks store theirs) unless one would not be a finite fp16 number."""
    rounded = values.half().float()
    return rounded if bool(torch.isfinite(rounded).all()) else values


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with zeros (all-zero groups) replaced by 1, for dividing."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)
