"""GPTQ checkpoints (``quant_method: "gptq"``, 4 bits, ``desc_act: false``), AutoGPTQ / GPTQModel /
optimum layout, ``checkpoint_format`` ``"gptq"`` (v1, the default) or ``"gptq_v2"``.

The packing, as read in AutoGPTQ's ``qlinear_cuda_old.py`` (``QuantLinear.pack`` and its torch
forward) and GPTQModel's ``convert_gptq_v1_to_v2_format_module``: for ``W [N, K]`` (out, in), group
size ``g`` (-1: one group, all of K),

- ``qweight`` int32 ``[K / 8, N]``, packed along K in plain order: bits ``4j`` of word ``[r, n]``
  hold ``q`` of input row ``8r + j``;
- ``qzeros`` int32 ``[K / g, N / 8]``, packed along N in plain order (bits ``4j`` of word
  ``[G, c]``: column ``8c + j``); v1 stores each zero point minus one (AutoGPTQ's ``zeros -= 1``
  before packing, ``zeros + 1`` after unpacking each nibble; GPTQModel's v1 -> v2 conversion adds
  ``0x11111111`` to the whole word, the same for every zero point 1..15 that v1 can store), v2
  stores it as is;
- ``scales`` fp16 ``[K / g, N]``; ``g_idx`` int32 ``[K]``: the group of each input row, which
  must be ``k // g`` (``desc_act`` reorders it: refused);
- ``W.T[k, n] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``.

``sym`` needs nothing special: a symmetric checkpoint stores its zero points (8) like any other.
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


class GptqFormat(CheckpointFormat):
    method = "gptq"
    leaves = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: dict[str, Any]) -> None:
        config_field(config, "bits", (4,), self.method)
        config_field(config, "desc_act", (False, None), self.method)
        config_field(config, "is_marlin_format", (False, None), self.method)
        fmt = config_field(config, "checkpoint_format", ("gptq", "gptq_v2"), self.method, "gptq")
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.group_size = config_field(config, "group_size", (*GROUP_SIZES, -1), self.method)
        self.symmetric = bool(config.get("sym", True))

    def is_quantized(self, prefix: str, tensors: CheckpointTensors) -> bool:
        return f"{prefix}.qweight" in tensors

    def scheme(self, prefix: str) -> QuantScheme:
        return QuantScheme(4, self.group_size if self.group_size > 0 else None, symmetric=self.symmetric)

    def read(self, prefix: str, tensors: CheckpointTensors) -> IntWeight:
        names = {leaf: f"{prefix}.{leaf}" for leaf in self.leaves}
        qweight, qzeros = get_int32(tensors, names["qweight"]), get_int32(tensors, names["qzeros"])
        scales = get_float(tensors, names["scales"])
        if qweight.dim() != 2:
            raise WeightError(f"tensor {names['qweight']!r} has shape {tuple(qweight.shape)}, expected [K / 8, N]")
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        group = self.group_size if self.group_size > 0 else k
        if k % group:
            raise WeightError(f"tensor {names['qweight']!r}: {k} input rows do not split into groups of {group}")
        expect_shape(names["qzeros"], qzeros, (k // group, n // 8))
        expect_shape(names["scales"], scales, (k // group, n))
        if names["g_idx"] in tensors:
            self._check_g_idx(names["g_idx"], tensors.get(names["g_idx"]), k, group)
        q = unpack_int32(qweight.T.contiguous(), 4)
        zero = unpack_int32(qzeros, 4).T + self.zero_offset
        return IntWeight(q, zero, scales.to(torch.float32).T, 4, names["qweight"])

    @staticmethod
    def _check_g_idx(name: str, g_idx: torch.Tensor, k: int, group: int) -> None:
        """``g_idx`` must map input row ``k`` to group ``k // group``."""
        expect_shape(name, g_idx, (k,))
        if not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group):
            raise WeightError(
                f"tensor {name!r} does not put input row k in group k // {group} (an act-order checkpoint): "
                "not supported"
            )
