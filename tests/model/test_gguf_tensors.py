"""GGUF tensor data as tokenmill weights: Q8_0/Q5_0/Q4_0/Q4_1/Q4_K/Q6_K repacked losslessly (their dequantized
values equal the ``gguf`` package's, bit for bit), other types dequantized by it; a file written with
``gguf``'s writer reads back through its reader; bad sizes are refused. ``gguf`` cannot quantize
K-quants, so their blocks are random bytes valid by the format's definition."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import (
    PANELS_INT8_GROUP,
    QuantizedTensors,
    QuantScheme,
    dequantize,
    fake_quantize_activations,
    to_panels,
)
from tokenmill.kernels.quant_linear import int8_dot_products, quantized_linear
from tokenmill.model.gguf_tensors import LOSSLESS, PANELS_ONLY, gguf_weight

N, K = 48, 96
K_QUANT_K = 512  # two super-blocks a row
Q = GGMLQuantizationType
K_QUANT_FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82)}
"""Byte offsets of each K-quant super-block's fp16 ``d`` (and ``dmin``); every other bit is quants or
packed scales, for which any pattern is valid."""


def weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)


def k_quant_blocks(qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """A random ``N x K_QUANT_K`` ``qtype`` tensor as rows of bytes: random bits, fp16 fields set to
    finite values of magnitude below 0.01."""
    rng = np.random.default_rng(seed)
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (N, K_QUANT_K // 256, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_FP16_FIELDS[qtype]:
        fp16 = rng.uniform(-0.01, 0.01, (N, K_QUANT_K // 256, 1)).astype(np.float16)
        blocks[..., offset : offset + 2] = fp16.view(np.uint8)
    return blocks.reshape(N, -1)


def stored(qtype: GGMLQuantizationType, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    """A random tensor's data in ``qtype`` as rows of bytes, and its shape ``[N, K]``."""
    if qtype in K_QUANT_FP16_FIELDS:
        return k_quant_blocks(qtype, seed), (N, K_QUANT_K)
    return quants.quantize(weights(seed), qtype), (N, K)


@pytest.mark.parametrize("qtype", LOSSLESS, ids=lambda t: t.name)
def test_lossless_types_dequantize_as_gguf_does_and_multiply_like_it(qtype: GGMLQuantizationType) -> None:
    raw, (n, k) = stored(qtype, int(qtype))
    ours = gguf_weight(raw, qtype, (n, k))
    group = PANELS_INT8_GROUP if qtype in PANELS_ONLY else 32
    assert isinstance(ours, QuantizedTensors) and ours.shape == (n, k) and ours.group == group
    theirs = torch.from_numpy(quants.dequantize(raw, qtype))
    assert torch.equal(dequantize(ours), theirs)
    assert ours.qweight.numel() * ours.qweight.element_size() == n * k * ours.bits // 8  # the packed bytes as stored
    x = torch.randn(3, k)
    if qtype not in PANELS_ONLY:
        torch.testing.assert_close(quantized_linear(x, ours), F.linear(x, theirs), rtol=1e-5, atol=1e-4)
    elif int8_dot_products():  # the panels layout's kernel quantizes x (to 1/508 of a block's step)
        expected = F.linear(fake_quantize_activations(x, group), theirs)
        torch.testing.assert_close(quantized_linear(x, to_panels(ours)), expected, rtol=1e-5, atol=1e-4)


def test_groups_of_16_are_refused_outside_the_panels_layout() -> None:
    raw, (n, k) = stored(Q.Q6_K, 3)
    layer = Linear(k, n, bias=False)
    with pytest.raises(ValueError, match="groups of 16 are kept in the panels layout only"):
        layer.load_quantized_(gguf_weight(raw, Q.Q6_K, (n, k)), QuantScheme(8, PANELS_INT8_GROUP))
    assert layer.quantization is None and layer.weight.shape == (n, k)


@pytest.mark.parametrize("qtype", [Q.Q5_1, Q.F16, Q.Q5_K, Q.Q3_K, Q.Q2_K], ids=lambda t: t.name)
def test_other_types_come_back_dequantized(qtype: GGMLQuantizationType) -> None:
    raw, shape = (weights(7).astype(np.float16), (N, K)) if qtype == Q.F16 else stored(qtype, 7)
    ours = gguf_weight(raw, qtype, shape)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32)))


def test_a_file_written_by_gguf_reads_back_through_its_reader(tmp_path: Path) -> None:
    path = tmp_path / "tensors.gguf"
    writer = GGUFWriter(str(path), "llama")
    originals = {}
    for i, qtype in enumerate(LOSSLESS):
        originals[qtype.name], _ = stored(qtype, 10 + i)
        writer.add_tensor(qtype.name, originals[qtype.name], raw_dtype=qtype)  # rows of blocks: [N, bytes]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in GGUFReader(str(path)).tensors:
        k, n = (int(d) for d in tensor.shape)  # ggml order: ne[0] (K) first
        ours = gguf_weight(tensor.data, tensor.tensor_type, (n, k))
        expected = quants.dequantize(originals[tensor.name], tensor.tensor_type)
        assert torch.equal(dequantize(ours), torch.from_numpy(expected))


def test_sizes_that_do_not_fit_are_refused() -> None:
    raw = quants.quantize(weights(1), Q.Q4_0)
    with pytest.raises(ValueError, match="not whole blocks"):
        gguf_weight(raw, Q.Q4_0, (N, 80))
    with pytest.raises(ValueError, match=r"48x64 Q4_0 tensor is 1728 bytes, the file holds 2592"):
        gguf_weight(raw, Q.Q4_0, (N, 64))
    raw, _ = stored(Q.Q4_K, 2)
    with pytest.raises(ValueError, match="Q4_K rows hold blocks of 256 values; K=96 is not whole blocks"):
        gguf_weight(raw, Q.Q4_K, (N, K))
    with pytest.raises(ValueError, match=r"48x256 Q4_K tensor is 6912 bytes, the file holds 13824"):
        gguf_weight(raw, Q.Q4_K, (N, 256))
