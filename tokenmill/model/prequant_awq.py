"""AutoAWQ checkpoints (``quant_method: "awq"``, ``version: "gemm"``, 4 bits, ``zero_point: true``).

The packing, as read in AutoAWQ's ``awq/utils/packing_utils.py`` (``AWQ_ORDER``,
``AWQ_REVERSE_ORDER``, ``unpack_awq``, ``dequantize_gemm``) and vLLM's ``awq_dequantize`` tests:
for ``W [N, K]`` (out, in), group size ``g``,

- ``qweight`` int32 ``[K, N / 8]``: the 8 nibbles of word ``c`` hold columns ``8c .. 8c + 7`` of
  ``W.T``, interleaved: nibble ``i`` (bits ``4i``) holds column ``8c + AWQ_ORDER[i]`` with
  ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``, i.e. column ``8c + j`` is nibble
  ``[0, 4, 1, 5, 2, 6, 3, 7][j]`` (the reverse order);
- ``qzeros`` int32 ``[K / g, N / 8]``: the zero points, packed the same way;
- ``scales`` fp16 ``[K / g, N]``;
- ``W.T[k, n] = (q[k, n] - zero[k // g, n]) * scale[k // g, n]``.

So ``q``, ``zero`` and ``scale`` are unpacked along N and transposed to tokenmill's ``[N, ...]``.
"""

from __future__ import annotations

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

NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
"""Which nibble of a packed word holds its column ``j`` (AutoAWQ's ``AWQ_REVERSE_ORDER``)."""


class AwqFormat(CheckpointFormat):
    method = "awq"
    leaves = ("qweight", "qzeros", "scales")

    def __init__(self, config: dict[str, Any]) -> None:
        config_field(config, "bits", (4,), self.method, config.get("w_bit"))
        config_field(config, "version", ("gemm", "GEMM"), self.method, "gemm")
        config_field(config, "zero_point", (True,), self.method, True)
        group_size = config.get("q_group_size")  # AutoAWQ's own quant_config.json name
        self.group_size = config_field(config, "group_size", (*GROUP_SIZES, -1), self.method, group_size)

    def is_quantized(self, prefix: str, tensors: CheckpointTensors) -> bool:
        return f"{prefix}.qweight" in tensors

    def scheme(self, prefix: str) -> QuantScheme:
        return QuantScheme(4, self.group_size if self.group_size > 0 else None, symmetric=False)

    def read(self, prefix: str, tensors: CheckpointTensors) -> IntWeight:
        names = {leaf: f"{prefix}.{leaf}" for leaf in self.leaves}
        qweight, qzeros = get_int32(tensors, names["qweight"]), get_int32(tensors, names["qzeros"])
        scales = get_float(tensors, names["scales"])
        if qweight.dim() != 2:
            raise WeightError(f"tensor {names['qweight']!r} has shape {tuple(qweight.shape)}, expected [K, N / 8]")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        group = self.group_size if self.group_size > 0 else k
        if k % group:
            raise WeightError(f"tensor {names['qweight']!r}: {k} input rows do not split into groups of {group}")
        expect_shape(names["qzeros"], qzeros, (k // group, n // 8))
        expect_shape(names["scales"], scales, (k // group, n))
        q = unpack_int32(qweight, 4, NIBBLE_OF_COLUMN).T
        zero = unpack_int32(qzeros, 4, NIBBLE_OF_COLUMN).T
        return IntWeight(q, zero, scales.to(torch.float32).T, 4, names["qweight"])
