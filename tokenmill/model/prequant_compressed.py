"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, llm-compressor's output):
``pack-quantized`` (W4A16, W8A16) and ``int-quantized`` / ``naive-quantized`` (W8A8, W8A16) integer
weights, symmetric or (int4) asymmetric, per channel, per group or per tensor.

The layout, as read in compressed-tensors' ``compressors/quantized_compressors/pack_quantized.py``
(``pack_to_int32``, ``unpack_from_int32``, ``compression_param_info``) and ``naive_quantized.py``:
for ``W [N, K]`` (out, in) quantized to signed ``v`` with scale ``s`` and zero point ``zp`` (signed,
0 when symmetric) per group of ``g`` values of a row, ``W[n, k] = (v - zp) * s``;

- ``pack-quantized``: ``weight_packed`` int32 ``[N, K / (32 / bits)]``, packed along K in plain
  order (bits ``bits * j`` of word ``c``: column ``c * 32 / bits + j``), each value stored
  unsigned as ``v + 2^(bits - 1)``; ``weight_shape`` ``[N, K]``; an asymmetric ``weight_zero_point``
  is packed the same way but along N (``[N / 8, K / g]``; an unpacked int8 ``[N, K / g]`` is read too);
- ``int-quantized`` / ``naive-quantized``: ``weight`` int8 ``[N, K]`` holding ``v``, an optional
  ``weight_zero_point`` ``[N, K / g]``;
- ``weight_scale`` ``[N, K / g]`` (``[N, 1]`` per channel, one value per tensor);
- an optional ``weight_g_idx`` must be ``k // g`` (activation order is refused).

So int4 maps to tokenmill's ``q = v + 8`` with zero ``zp + 8``, int8 to ``q = v`` (symmetric only).
The ``config_groups`` (``targets``: ``"Linear"``, a module name or ``"re:<regex>"``) give each
projection its arguments; which projections are quantized is read from the tensors (``ignore``d
ones are stored as plain weights). The config's activation quantization (W8A8's
``input_activations``, and any ``input_scale`` tensors) is not read: the projections compute as
every quantized one does, i.e. in the panels layout (where ``quantization.panels_on_cpu``) with
activations quantized to int8 dynamically per block of each row (``kernels/quant_linear.py``), else
with activations in the model's dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.kernels.quant_format import GROUP_SIZES, QuantScheme
from tokenmill.model.prequant_format import (
    CheckpointFormat,
    CheckpointTensors,
    IntWeight,
    config_field,
    expect_shape,
    get_float,
    get_int32,
    unpack_int32,
)
from tokenmill.model.weights import WeightError

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightArgs:
    """One config group's weight arguments: ``format``, ``bits``, ``symmetric``, ``strategy``
    ("channel", "group" or "tensor"), ``group_size`` (groups only), ``targets``."""

    format: str
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    targets: tuple[str, ...]

    @classmethod
    def parse(cls, name: str, group: dict[str, Any], default_format: str | None) -> WeightArgs:
        where = f"{METHOD} config group {name!r}"
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ValueError(f"{where} has no 'weights' arguments (tokenmill loads quantized weights only)")
        fmt = config_field({"format": group.get("format") or default_format}, "format", FORMATS, where)
        config_field(weights, "type", ("int",), where, "int")
        bits = config_field(weights, "num_bits", (4, 8), where)
        strategy = config_field(weights, "strategy", ("channel", "group", "tensor"), where)
        config_field(weights, "dynamic", (False, None), where, False)
        symmetric = bool(weights.get("symmetric", True))
        group_size = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and group_size not in GROUP_SIZES:
            raise ValueError(f"{where}: group_size {group_size!r} is not supported (supported: {GROUP_SIZES})")
        if bits == 8 and not symmetric:
            raise ValueError(f"{where}: asymmetric int8 weights are not supported")
        targets = tuple(group.get("targets") or ("Linear",))
        return cls(fmt, bits, symmetric, strategy, group_size, targets)

    def matches(self, prefix: str) -> bool:
        """Whether module ``prefix`` (a Linear) is one of :attr:`targets`."""
        return any(
            target == "Linear" or target == prefix or (target.startswith("re:") and re.match(target[3:], prefix))
            for target in self.targets
        )


class CompressedTensorsFormat(CheckpointFormat):
    method = METHOD
    leaves = (
        "weight_packed",
        "weight_shape",
        "weight_scale",
        "weight_zero_point",
        "weight_g_idx",
        "input_scale",
        "input_zero_point",
    )

    def __init__(self, config: dict[str, Any]) -> None:
        config_field(config, "quantization_status", ("compressed",), METHOD, "compressed")
        config_field(config, "kv_cache_scheme", (None,), METHOD)
        sparsity = config.get("sparsity_config") or {}
        config_field(sparsity, "format", ("dense", None), f"{METHOD} sparsity_config")
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{METHOD} checkpoint: quantization_config has no config_groups")
        self.groups = [WeightArgs.parse(name, group, config.get("format")) for name, group in groups.items()]

    def args(self, prefix: str) -> WeightArgs:
        """The first config group that targets projection ``prefix``."""
        for args in self.groups:
            if args.matches(prefix):
                return args
        raise ValueError(f"{METHOD} checkpoint: no config group targets {prefix}, whose weight is stored quantized")

    def is_quantized(self, prefix: str, tensors: CheckpointTensors) -> bool:
        return f"{prefix}.weight_packed" in tensors or f"{prefix}.weight_scale" in tensors

    def scheme(self, prefix: str) -> QuantScheme:
        args = self.args(prefix)
        return QuantScheme(args.bits, args.group_size, symmetric=args.symmetric)

    def tensor_names(self, prefix: str) -> tuple[str, ...]:
        """The full names of the tensors a quantized projection ``prefix`` may have (``weight`` too:
        int-quantized projections keep that name for their integers)."""
        return (f"{prefix}.weight", *(f"{prefix}.{leaf}" for leaf in self.leaves))

    def read(self, prefix: str, tensors: CheckpointTensors) -> IntWeight:
        args = self.args(prefix)
        if args.format == "pack-quantized":
            name = f"{prefix}.weight_packed"
            values = self._unpacked_values(prefix, tensors, args.bits)
        else:
            name = f"{prefix}.weight"
            values = tensors.get(name)
            if values.dtype != torch.int8 or values.dim() != 2:
                raise WeightError(f"tensor {name!r} has dtype {values.dtype}, expected int8 [N, K]")
        n, k = values.shape
        scale_name = f"{prefix}.weight_scale"
        scale = get_float(tensors, scale_name).to(torch.float32)
        if args.strategy == "tensor":
            scale = scale.reshape(-1)[:1].expand(n, 1) if scale.numel() == 1 else scale
        groups = k // args.group_size if args.group_size else 1
        if args.group_size and k % args.group_size:
            raise WeightError(f"tensor {name!r}: {k} input columns do not split into groups of {args.group_size}")
        expect_shape(scale_name, scale, (n, groups))
        zero = self._zero_points(prefix, tensors, args, (n, groups))
        self._check_g_idx(prefix, tensors, k, k // groups)
        offset = 8 if args.bits == 4 else 0  # tokenmill's int4 values are unsigned
        return IntWeight(values.to(torch.int32) + offset, zero + offset, scale, args.bits, name)

    @staticmethod
    def _unpacked_values(prefix: str, tensors: CheckpointTensors, bits: int) -> torch.Tensor:
        """The signed values of ``weight_packed``, ``[N, K]`` as ``weight_shape`` says."""
        name, shape_name = f"{prefix}.weight_packed", f"{prefix}.weight_shape"
        packed = get_int32(tensors, name)
        shape = tuple(int(d) for d in tensors.get(shape_name).reshape(-1).tolist())
        per_word = 32 // bits
        if len(shape) != 2 or packed.dim() != 2:
            raise WeightError(f"tensor {shape_name!r} ({shape}) or {name!r} is not a 2-d weight's")
        expect_shape(name, packed, (shape[0], -(-shape[1] // per_word)))
        return unpack_int32(packed, bits)[:, : shape[1]] - (1 << (bits - 1))

    @staticmethod
    def _zero_points(prefix: str, tensors: CheckpointTensors, args: WeightArgs, shape: tuple[int, int]) -> torch.Tensor:
        """The signed zero points ``[N, groups]`` (zeros when the checkpoint stores none)."""
        name = f"{prefix}.weight_zero_point"
        if name not in tensors:
            if not args.symmetric:
                raise WeightError(f"checkpoint is missing tensor {name!r} (asymmetric weights need zero points)")
            return torch.zeros(shape, dtype=torch.int32)
        zero = tensors.get(name)
        if zero.dtype == torch.int32 and args.format == "pack-quantized":  # packed along N, stored unsigned
            per_word = 32 // args.bits
            expect_shape(name, zero, (-(-shape[0] // per_word), shape[1]))
            return unpack_int32(zero.T.contiguous(), args.bits).T[: shape[0]] - (1 << (args.bits - 1))
        if zero.is_floating_point() or zero.numel() not in (1, shape[0] * shape[1]):
            raise WeightError(f"tensor {name!r} has shape {tuple(zero.shape)}, expected integers {shape}")
        return zero.to(torch.int32).reshape(-1).expand(shape[0] * shape[1]).reshape(shape).clone()

    @staticmethod
    def _check_g_idx(prefix: str, tensors: CheckpointTensors, k: int, group: int) -> None:
        name = f"{prefix}.weight_g_idx"
        if name in tensors and not torch.equal(tensors.get(name).to(torch.int64), torch.arange(k) // group):
            raise WeightError(f"tensor {name!r} reorders the groups (activation order): not supported")
