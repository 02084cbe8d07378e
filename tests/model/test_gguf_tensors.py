"""GGUF tensor data as tokenmill weights: Q8_0/Q4_0/Q4_1 repacked losslessly (their dequantized
values equal the ``gguf`` package's, bit for bit), other types dequantized by it; a file written with
``gguf``'s writer reads back through its reader; bad sizes are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from tokenmill.kernels.quant_format import QuantizedTensors, dequantize
from tokenmill.kernels.quant_linear import quantized_linear
from tokenmill.model.gguf_tensors import LOSSLESS, gguf_weight

N, K = 48, 96


def weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)


@pytest.mark.parametrize("qtype", LOSSLESS, ids=lambda t: t.name)
def test_lossless_types_dequantize_as_gguf_does_and_multiply_like_it(qtype: GGMLQuantizationType) -> None:
    raw = quants.quantize(weights(int(qtype)), qtype)
    ours = gguf_weight(raw, qtype, (N, K))
    assert isinstance(ours, QuantizedTensors) and ours.shape == (N, K) and ours.group == 32
    theirs = torch.from_numpy(quants.dequantize(raw, qtype))
    assert torch.equal(dequantize(ours), theirs)
    assert ours.qweight.numel() * ours.qweight.element_size() == N * K * ours.bits // 8  # the packed bytes as stored
    x = torch.randn(3, K)
    torch.testing.assert_close(quantized_linear(x, ours), F.linear(x, theirs), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.F16], ids=lambda t: t.name)
def test_other_types_come_back_dequantized(qtype: GGMLQuantizationType) -> None:
    data = weights(7)
    raw = quants.quantize(data, qtype) if qtype != GGMLQuantizationType.F16 else data.astype(np.float16)
    ours = gguf_weight(raw, qtype, (N, K))
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32)))


def test_a_file_written_by_gguf_reads_back_through_its_reader(tmp_path: Path) -> None:
    path = tmp_path / "tensors.gguf"
    writer = GGUFWriter(str(path), "llama")
    originals = {}
    for i, qtype in enumerate(LOSSLESS):
        originals[qtype.name] = quants.quantize(weights(10 + i), qtype)
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
    raw = quants.quantize(weights(1), GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="not whole blocks"):
        gguf_weight(raw, GGMLQuantizationType.Q4_0, (N, 80))
    with pytest.raises(ValueError, match=r"48x64 Q4_0 tensor is 1728 bytes, the file holds 2592"):
        gguf_weight(raw, GGMLQuantizationType.Q4_0, (N, 64))
