"""A GGUF file's tensor data as tokenmill weights (the first piece of GGUF support).

ggml stores a 2-D weight as rows of K values (``ne[0]``, contiguous), cut into blocks of 32. The
block types the quantized kernels run exactly are repacked losslessly into
``kernels/quant_format``'s rows layout, groups of 32:

- Q8_0 (fp16 ``d``, 32 int8 ``q``; ``w = q d``): int8, ``scale = d``;
- Q4_0 (fp16 ``d``, 16 bytes; ``w = (q - 8) d``): int4, ``scale = d``, ``min = -8 d``;
- Q4_1 (fp16 ``d``, fp16 ``m``, 16 bytes; ``w = q d + m``): int4, ``scale = d``, ``min = m``.

A block's 16 bytes hold value ``j`` in byte ``j``'s low nibble and value ``16 + j`` in its high one,
which is tokenmill's int4 run layout already: the bytes are copied as they are. Every other type
(F32, F16, BF16, Q5_*, K-quants, ...) comes back dequantized to fp32 by the ``gguf`` package.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as GGMLType

from tokenmill.kernels.quant_format import QuantizedTensors

LOSSLESS = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1)
"""The block types repacked into quantized weights as they are."""


def gguf_weight(raw: np.ndarray, qtype: GGMLType, shape: tuple[int, int]) -> QuantizedTensors | torch.Tensor:
    """The weight ``[N, K]`` (``shape``, torch order) whose data the file stores as ``raw`` (its
    bytes, rows contiguous; any shape and dtype, e.g. what ``gguf.GGUFReader`` gives) in ``qtype``:
    quantized tensors for :data:`LOSSLESS` types, else an fp32 tensor. Raises ValueError, naming the
    numbers, when K is not whole blocks or the bytes are not the size the type and shape need."""
    n, k = shape
    values_per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    if k % values_per_block:
        raise ValueError(f"{qtype.name} rows hold blocks of {values_per_block} values; K={k} is not whole blocks")
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    expected = n * (k // values_per_block) * block_bytes
    if data.size != expected:
        raise ValueError(f"a {n}x{k} {qtype.name} tensor is {expected} bytes, the file holds {data.size}")
    rows = data.reshape(n, -1)
    if qtype not in LOSSLESS:
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(rows, qtype), dtype=np.float32)).reshape(n, k)
    blocks = rows.reshape(n, k // values_per_block, block_bytes)
    scale = _fp16(blocks[..., 0:2])
    if qtype == GGMLType.Q8_0:
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantizedTensors(torch.from_numpy(values), scale, None, 8, values_per_block)
    low = _fp16(blocks[..., 2:4]) if qtype == GGMLType.Q4_1 else -8.0 * scale
    packed = blocks[..., 4:] if qtype == GGMLType.Q4_1 else blocks[..., 2:]
    return QuantizedTensors(torch.from_numpy(np.ascontiguousarray(packed).reshape(n, k // 2)), scale, low, 4, 32)


def _fp16(pairs: np.ndarray) -> torch.Tensor:
    """Byte pairs ``[..., 2]`` read as little-endian fp16, as an fp32 tensor ``[...]``."""
    return torch.from_numpy(np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32))
