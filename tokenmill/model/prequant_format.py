"""What every pre-quantized checkpoint format reduces to: :class:`IntWeight`, one projection's integer
values with the checkpoint's own dequantization formula ``w = (q - zero) * scale``, and the
:class:`CheckpointFormat` contract each format (``prequant_awq.py``, ``prequant_gptq.py``,
``prequant_compressed.py``) implements. :meth:`IntWeight.to_quantized` repacks it exactly into
tokenmill's layout (``kernels/quant_format.py``): int4 ``scale = s``, ``min = -zero * s`` (so
``q * scale + min`` is ``(q - zero) * s``); int8 ``scale = s`` with ``zero`` 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open

from tokenmill.kernels.quant_format import RUN, QuantizedTensors, QuantScheme, pack_int4
from tokenmill.model.weights import WeightError, check_finite


class CheckpointTensors:
    """The tensors of a checkpoint by name, read from their files on demand (each file opened once,
    its header parsed once, for the life of this object)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files  # tensor name -> the safetensors file holding it
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (:class:`WeightError` when the checkpoint has none)."""
        file = self.files.get(name)
        if file is None:
            raise WeightError(f"checkpoint is missing tensor {name!r}")
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file].get_tensor(name)


@dataclass
class IntWeight:
    """One projection ``W [N, K]`` as integers: ``W = (q - zero) * scale`` per group of ``K / G``
    consecutive values of a row. ``q`` int32 ``[N, K]`` (int4: 0..15; int8: -128..127), ``zero``
    int32 ``[N, G]`` (int8: all zero), ``scale`` fp32 ``[N, G]``; ``name`` is the checkpoint
    tensor the values came from (for errors)."""

    q: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    bits: int
    name: str

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def check(self) -> None:
        """Raise :class:`WeightError` naming the tensor unless the values fit the bits, the shapes
        agree and the group is one tokenmill's kernels run (a multiple of 32 dividing K that is a
        power of two or all of K)."""
        n, k = self.q.shape
        groups = self.scale.shape[1]
        if self.scale.shape[0] != n or tuple(self.zero.shape) != tuple(self.scale.shape) or k % groups:
            raise WeightError(
                f"tensor {self.name!r}: {n}x{k} values with scales {tuple(self.scale.shape)} and zeros "
                f"{tuple(self.zero.shape)} do not describe whole groups"
            )
        group = k // groups
        if group % RUN or (group & (group - 1) and groups != 1):
            raise WeightError(
                f"tensor {self.name!r}: group size {group} is not supported (a multiple of {RUN} that is a "
                "power of two, or one group per row)"
            )
        low, high = (0, 15) if self.bits == 4 else (-128, 127)
        if int(self.q.min()) < low or int(self.q.max()) > high:
            raise WeightError(f"tensor {self.name!r}: int{self.bits} values outside {low}..{high}")
        if self.bits == 8 and bool(self.zero.any()):
            raise WeightError(f"tensor {self.name!r}: int8 weights with zero points are not supported (symmetric only)")
        check_finite(self.scale, f"tensor {self.name!r}'s scales")

    def take(self, rows: slice, cols: slice) -> IntWeight:
        """The part ``W[rows, cols]``; ``cols`` must hold whole groups (or cut the one group of a row)."""
        n, k = self.q.shape
        start, stop, _ = cols.indices(k)
        group = self.group
        if self.scale.shape[1] == 1:
            groups = slice(None)
        elif start % group or stop % group:
            raise WeightError(
                f"tensor {self.name!r}: columns {start}:{stop} of this rank's shard split groups of {group}; "
                "use a tensor_parallel_size whose shard of K holds whole groups"
            )
        else:
            groups = slice(start // group, stop // group)
        return IntWeight(
            self.q[rows, start:stop], self.zero[rows, groups], self.scale[rows, groups], self.bits, self.name
        )

    def to_quantized(self, device: torch.device) -> QuantizedTensors:
        """The same weight in tokenmill's layout (exact: see the module docstring), on ``device``."""
        scale = self.scale.float().contiguous()
        if self.bits == 8:
            return QuantizedTensors(self.q.to(torch.int8).to(device), scale.to(device), None, 8, self.group)
        low = -self.zero.float() * scale
        packed = pack_int4(self.q.to(torch.uint8))
        return QuantizedTensors(packed.to(device), scale.to(device), low.contiguous().to(device), 4, self.group)


def concat_rows(parts: list[IntWeight]) -> IntWeight:
    """The shards of a packed projection stacked along N; they must share bits and group size."""
    first = parts[0]
    for part in parts[1:]:
        if (part.bits, part.group, part.scale.shape[1]) != (first.bits, first.group, first.scale.shape[1]):
            raise WeightError(
                f"tensors {first.name!r} (int{first.bits}, groups of {first.group}) and {part.name!r} "
                f"(int{part.bits}, groups of {part.group}) are packed into one projection: they must be "
                "quantized alike"
            )
    if len(parts) == 1:
        return first
    return IntWeight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.zero for p in parts]),
        torch.cat([p.scale for p in parts]),
        first.bits,
        first.name,
    )


def unpack_int32(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[R, C]`` holding ``32 / bits`` values each -> int32 ``[R, C * 32 / bits]``, value
    ``j`` of word ``c`` going to column ``c * 32 / bits + j``. Value ``j`` sits at bits
    ``bits * order[j]`` (``order`` None: ``bits * j``)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)
    if order is not None:
        values = values[:, :, list(order)]
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def get_int32(tensors: CheckpointTensors, name: str) -> torch.Tensor:
    """Tensor ``name``, which must be int32 (packed integers)."""
    tensor = tensors.get(name)
    if tensor.dtype != torch.int32:
        raise WeightError(f"tensor {name!r} has dtype {tensor.dtype}, expected torch.int32 (packed integers)")
    return tensor


def get_float(tensors: CheckpointTensors, name: str) -> torch.Tensor:
    """Tensor ``name``, which must be floating-point (scales)."""
    tensor = tensors.get(name)
    if not tensor.is_floating_point():
        raise WeightError(f"tensor {name!r} has dtype {tensor.dtype}, expected a floating-point dtype")
    return tensor


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise :class:`WeightError` unless ``tensor`` (checkpoint tensor ``name``) has ``shape``."""
    if tuple(tensor.shape) != shape:
        raise WeightError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")


def config_field(config: dict[str, Any], field: str, allowed: tuple[Any, ...], where: str, default: Any = None) -> Any:
    """``config[field]`` (``default`` when absent), which must be one of ``allowed`` (ValueError naming
    ``where``, e.g. the quantization method, and the field)."""
    value = config.get(field, default)
    if value not in allowed:
        raise ValueError(
            f"{where}: quantization_config field {field}={value!r} is not supported (supported: "
            f"{', '.join(repr(a) for a in allowed)})"
        )
    return value


class CheckpointFormat(ABC):
    """One pre-quantized checkpoint format, parsed from ``config.json``'s ``quantization_config``
    (its constructor raises ValueError naming the field it does not support)."""

    method: ClassVar[str]
    """``quant_method`` as the config names it."""
    leaves: ClassVar[tuple[str, ...]]
    """Names of the tensors (after the module's name) a quantized projection may have."""

    def tensor_names(self, prefix: str) -> tuple[str, ...]:
        """The full names of the tensors a quantized projection ``prefix`` may have."""
        return tuple(f"{prefix}.{leaf}" for leaf in self.leaves)

    @abstractmethod
    def is_quantized(self, prefix: str, tensors: CheckpointTensors) -> bool:
        """Whether the projection named ``prefix`` is stored quantized in ``tensors``."""

    @abstractmethod
    def scheme(self, prefix: str) -> QuantScheme:
        """The scheme the quantized projection ``prefix`` is stored with (ValueError if none applies)."""

    @abstractmethod
    def read(self, prefix: str, tensors: CheckpointTensors) -> IntWeight:
        """The whole projection ``prefix`` read from ``tensors`` (raises :class:`WeightError` naming the
        tensor that is missing or does not fit the config)."""
