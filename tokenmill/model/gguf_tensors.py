"""A GGUF file's tensor data as tokenmill weights (the first piece of GGUF support).

ggml stores a 2-D weight as rows of K values (``ne[0]``, contiguous), cut into blocks (32 values; 256,
in sub-blocks of 32, for K-quants). The block types the quantized kernels run exactly are repacked
losslessly into ``kernels/quant_format``'s rows layout, groups of 32:

- Q8_0 (fp16 ``d``, 32 int8 ``q``; ``w = q d``): int8, ``scale = d``;
- Q5_0 (fp16 ``d``, 4 bytes of fifth bits, 16 bytes of nibbles; ``w = (q - 16) d``): int8 ``q - 16``,
  ``scale = d`` (a 5-bit value fits int8 as it is);
- Q4_0 (fp16 ``d``, 16 bytes; ``w = (q - 8) d``): int4, ``scale = d``, ``min = -8 d``;
- Q4_1 (fp16 ``d``, fp16 ``m``, 16 bytes; ``w = q d + m``): int4, ``scale = d``, ``min = m``;
- Q4_K (fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit ``sc`` and ``m`` per sub-block, 128 bytes;
  ``w = q d sc - dmin m``): int4, ``scale = d sc``, ``min = -dmin m`` (both exact in fp32);
- Q6_K (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 ``sc``, fp16 ``d``; sub-blocks of
  16; ``w = (q - 32) d sc``): int8 ``q - 32`` in groups of 16 (``quant_format.PANELS_INT8_GROUP``),
  ``scale = d sc``, which only the panels layout holds (:data:`PANELS_ONLY`).

A Q4_0/Q4_1 block's 16 bytes hold value ``j`` in byte ``j``'s low nibble and value ``16 + j`` in its
high one, which is tokenmill's int4 run layout already: the bytes are copied as they are. Q4_K holds
each 64 values in 32 bytes, values 0-31 in the low nibbles and 32-63 in the high ones: its nibbles
are reshuffled into runs; Q6_K's 6-bit values are put together from their two parts. Every other
type (F32, F16, BF16, Q5_1, other K-quants, ...) comes back dequantized to fp32 by the ``gguf``
package.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as GGMLType

from tokenmill.kernels.quant_format import QuantizedTensors

LOSSLESS_BITS = {
    GGMLType.Q8_0: 8,
    GGMLType.Q5_0: 8,
    GGMLType.Q4_0: 4,
    GGMLType.Q4_1: 4,
    GGMLType.Q4_K: 4,
    GGMLType.Q6_K: 8,
}
"""The block types repacked into quantized weights as they are -> the bit width they become."""
LOSSLESS = tuple(LOSSLESS_BITS)
PANELS_ONLY = frozenset({GGMLType.Q6_K})
"""The lossless types whose groups (16 values) only the panels layout holds."""


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
        return torch.from_numpy(np.array(quants.dequantize(rows, qtype), dtype=np.float32)).reshape(n, k)
    blocks = rows.reshape(n, k // values_per_block, block_bytes)
    if qtype == GGMLType.Q4_K:
        return _q4_k(blocks)
    if qtype == GGMLType.Q6_K:
        return _q6_k(blocks)
    scale = _fp16(blocks[..., 0:2])
    if qtype == GGMLType.Q5_0:
        return QuantizedTensors(torch.from_numpy(_q5_0_values(blocks).reshape(n, k)), scale, None, 8, 32)
    if qtype == GGMLType.Q8_0:
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantizedTensors(torch.from_numpy(values), scale, None, 8, values_per_block)
    low = _fp16(blocks[..., 2:4]) if qtype == GGMLType.Q4_1 else -8.0 * scale
    packed = blocks[..., 4:] if qtype == GGMLType.Q4_1 else blocks[..., 2:]
    return QuantizedTensors(torch.from_numpy(np.ascontiguousarray(packed).reshape(n, k // 2)), scale, low, 4, 32)


def _q5_0_values(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks ``[..., 22]`` as their int8 values ``q - 16`` ``[..., 32]``: value ``j < 16`` is
    byte ``j``'s low nibble, value ``16 + j`` its high one, each with bit ``j`` (``16 + j``) of the
    little-endian 32-bit ``qh`` as its fifth bit."""
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [..., 1]
    nibbles = blocks[..., 6:22]
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int16)
    fifth = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    return ((low | (fifth << 4)) - 16).astype(np.int8)


def _q4_k(blocks: np.ndarray) -> QuantizedTensors:
    """Q4_K super-blocks ``[N, K / 256, 144]`` as int4 groups of 32 (see the module docstring)."""
    n, supers, _ = blocks.shape
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    # 12 bytes a, b, c of 4: sc[0:4] = a's low 6 bits, m[0:4] = b's; sc[4:8] = c's low nibble with a's
    # top 2 bits above it, m[4:8] = c's high nibble with b's top 2 bits above it.
    a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([a & 63, (c & 15) | (a >> 6 << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | (b >> 6 << 4)], axis=-1)
    scale = d[..., None] * torch.from_numpy(sc.astype(np.float32))
    low = -dmin[..., None] * torch.from_numpy(m.astype(np.float32))
    # Per 64 values, byte i < 32 holds value i (low nibble) and 32 + i (high): the run of values 0-31
    # takes the low nibbles of bytes j and 16 + j, the run of 32-63 their high nibbles.
    chunks = blocks[..., 16:].reshape(n, supers, 4, 2, 16)  # [64 values, bytes 0-15 | 16-31, j]
    first, second = chunks[..., 0, :], chunks[..., 1, :]
    runs = np.stack([(first & 15) | (second << 4), (first >> 4) | (second & 0xF0)], axis=-2)
    return QuantizedTensors(torch.from_numpy(runs.reshape(n, -1)), scale.reshape(n, -1), low.reshape(n, -1), 4, 32)


def _q6_k(blocks: np.ndarray) -> QuantizedTensors:
    """Q6_K super-blocks ``[N, K / 256, 210]`` as int8 groups of 16 (see the module docstring)."""
    n, supers, _ = blocks.shape
    # Per half of 128 values: 64 bytes ql, 32 bytes qh. Value 32 i + j (i < 4, j < 32) has as low
    # nibble that of ql byte j (i even) or 32 + j (i odd), low for i < 2 and high above, and as its
    # top two bits bits 2 i, 2 i + 1 of qh byte j.
    ql = blocks[..., :128].reshape(n, supers, 2, 64)
    qh = blocks[..., 128:192].reshape(n, supers, 2, 1, 32)
    low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    values = ((low | (high << 4)).astype(np.int8) - 32).reshape(n, -1)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _fp16(blocks[..., 208:210])[..., None] * torch.from_numpy(sc)
    return QuantizedTensors(torch.from_numpy(values), scale.reshape(n, -1), None, 8, 16)


def _fp16(pairs: np.ndarray) -> torch.Tensor:
    """Byte pairs ``[..., 2]`` read as little-endian fp16, as an fp32 tensor ``[...]``."""
    return torch.from_numpy(np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32))
