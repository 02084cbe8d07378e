"""Weights kept quantized: the format (packing, round-to-nearest bounds), the C++ products against
``F.linear`` on the dequantized weight, and a quantized Linear's memory."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.hardware import cpu_flags
from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import (
    QuantizedTensors,
    QuantScheme,
    dequantize,
    fake_quantize_activations,
    from_panels,
    pack_int4,
    quantize,
    to_panels,
    unpack_int4,
)
from tokenmill.kernels.quant_linear import (
    ONE_PASS_PANELS_MAX_ROWS,
    PANELS_MAX_ROWS,
    STREAM_MAX_ROWS,
    activation_block,
    int8_dot_isa,
    int8_dot_products,
    int8_dot_tiles,
    quantized_linear,
)

SCHEMES = [
    QuantScheme(8),
    QuantScheme(8, 32),
    QuantScheme(4, 64, symmetric=False),
    QuantScheme(4, 32, symmetric=True),
    QuantScheme(4, None, symmetric=False),  # int4 default: the largest group dividing K
]


def test_int4_packing_puts_value_j_low_and_16_plus_j_high_in_byte_j_of_each_run() -> None:
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 32)
    for run in range(2):
        for j in range(16):
            byte = packed[:, 16 * run + j]
            assert torch.equal(byte & 15, q[:, 32 * run + j]) and torch.equal(byte >> 4, q[:, 32 * run + 16 + j])
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_round_to_nearest_error_is_at_most_half_a_step(scheme: QuantScheme) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 192) * torch.rand(48, 1) * 3
    w[5] = 0.0  # an all-zero row quantizes exactly
    tensors = quantize(w, scheme)
    group = tensors.group
    assert group == (scheme.group_size or (192 if scheme.bits == 8 else 64))
    error = (dequantize(tensors) - w).abs().reshape(48, -1, group)
    assert (error <= tensors.scale[..., None] / 2 + 1e-6).all()
    assert torch.equal(dequantize(tensors)[5], torch.zeros(192))
    expected_bytes = 48 * 192 * scheme.bits // 8
    assert tensors.qweight.numel() * tensors.qweight.element_size() == expected_bytes


needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ CPU kernels (a compiler)")


@needs_kernels
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("rows", [1, 3, STREAM_MAX_ROWS, STREAM_MAX_ROWS + 1, 40])
def test_kernel_equals_linear_on_the_dequantized_weight(scheme: QuantScheme, rows: int) -> None:
    torch.manual_seed(rows)
    w, x, bias = torch.randn(70, 256), torch.randn(rows, 256), torch.randn(70)  # N: 17 blocks of 4 and 2 rows
    tensors = quantize(w, scheme)
    expected = F.linear(x, dequantize(tensors), bias)
    torch.testing.assert_close(quantized_linear(x, tensors, bias), expected, rtol=1e-5, atol=1e-4)
    got_bf16 = quantized_linear(x.bfloat16(), tensors, bias.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(
        got_bf16.float(), F.linear(x.bfloat16().float(), dequantize(tensors), bias), rtol=2e-2, atol=0.1
    )
    kernels = load_cpu_kernels()
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):  # fused multiply-add: fp32 rounding
        whole = kernels.dequantize_weight(
            tensors.qweight, tensors.scale, tensors.min, tensors.bits, tensors.group, dtype
        )
        torch.testing.assert_close(whole, dequantize(tensors, dtype), rtol=tolerance, atol=tolerance)


@needs_kernels
@pytest.mark.parametrize("scheme", [QuantScheme(8, 32), QuantScheme(4, 32, symmetric=False)], ids=lambda s: s.name)
@pytest.mark.parametrize(
    "n, k, rows",
    [(4100, 256, STREAM_MAX_ROWS + 1), (70, 1024, min(40, STREAM_MAX_ROWS))],
    ids=["weight-chunks", "x-chunks"],
)
def test_products_cross_the_chunks_of_weight_and_of_x(scheme: QuantScheme, n: int, k: int, rows: int) -> None:
    """Beyond STREAM_MAX_ROWS the weight is dequantized 2**20 values at a time (4,096 rows of K=256:
    N=4,100 ends in a chunk of 4 rows); a streaming thread takes ~128 KiB of x at a time (32 rows of
    K=1024: 40 rows, which AVX2 alone streams, end in a chunk of 8)."""
    torch.manual_seed(n + rows)
    w, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    tensors = quantize(w, scheme)
    expected = F.linear(x, dequantize(tensors), bias)
    torch.testing.assert_close(quantized_linear(x, tensors, bias), expected, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_kernel_refuses_inconsistent_operands() -> None:
    tensors = quantize(torch.randn(8, 64), QuantScheme(4, 32, symmetric=False))
    kernels = load_cpu_kernels()
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="scale"):
        kernels.quantized_linear(x, tensors.qweight, tensors.scale[:, :1].contiguous(), tensors.min, 4, 32, None, 16)
    with pytest.raises(RuntimeError, match="need mins"):
        kernels.quantized_linear(x, tensors.qweight, tensors.scale, None, 4, 32, None, 16)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.quantized_linear(torch.randn(1, 32), tensors.qweight, tensors.scale, tensors.min, 4, 32, None, 16)


def test_schemes_and_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="8 or 4 bits"):
        QuantScheme(3)
    with pytest.raises(ValueError, match="group size"):
        QuantScheme(4, 48)
    with pytest.raises(ValueError, match="symmetric"):
        QuantScheme(8, symmetric=False)
    layer = Linear(96, 8, bias=False)
    with pytest.raises(ValueError, match="groups of 64"):
        layer.quantize_(QuantScheme(4, 64))
    assert layer.quantization is None and layer.weight.shape == (8, 96)  # unchanged


def test_a_quantized_linear_holds_only_the_quantized_bytes_and_computes_with_them() -> None:
    torch.manual_seed(0)
    layer = Linear(256, 64, bias=True)
    full = layer.weight.detach().clone()
    layer.quantize_(QuantScheme(4, 64, symmetric=False))
    assert not hasattr(layer, "weight") and layer.quantization == QuantScheme(4, 64, symmetric=False)
    stored = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    # 4 bits a weight, fp32 scale and min per 64 values, the fp32 bias
    assert stored == 64 * 256 // 2 + 2 * 4 * 64 * 256 // 64 + 4 * 64
    x = torch.randn(2, 256)
    torch.testing.assert_close(layer(x), F.linear(x, dequantize(layer.quantized_weight()), layer.bias))
    assert (dequantize(layer.quantized_weight()) - full).abs().max() < 0.25
    with pytest.raises(ValueError, match="already quantized"):
        layer.quantize_(QuantScheme(8))


@pytest.mark.parametrize("bits", [8, 4])
def test_panels_put_a_panels_quad_in_one_vector_and_round_trip(bits: int) -> None:
    """Lane r of panel p's quad t holds row 16 p + r's values 4 t .. 4 t + 3 (int4: byte 4 r + i of the
    64 of quads t and t + 1, t even, holds quad t's value in its low nibble and quad t + 1's in its high
    one); scales go to [N / 16, K / g, 16]."""
    torch.manual_seed(bits)
    tensors = quantize(torch.randn(48, 128), QuantScheme(bits, 32, symmetric=bits == 8))
    panels = to_panels(tensors)
    values = tensors.qweight if bits == 8 else unpack_int4(tensors.qweight)
    assert panels.panels and panels.shape == (48, 128) and panels.scale.shape == (3, 4, 16)
    assert panels.scale[1, 2, 5] == tensors.scale[16 + 5, 2]
    assert panels.qweight.shape == (3, 32, 64 if bits == 8 else 32)
    for p, t, r, i in [(0, 0, 0, 0), (1, 5, 3, 2), (2, 31, 15, 3), (2, 7, 9, 1)]:
        value = values[16 * p + r, 4 * t + i]
        if bits == 8:
            assert panels.qweight[p, t, 4 * r + i] == value
        else:
            byte = panels.qweight[p].reshape(-1, 64)[t // 2, 4 * r + i]
            assert (byte & 15 if t % 2 == 0 else byte >> 4) == value
    back = from_panels(panels)
    assert torch.equal(back.qweight, tensors.qweight) and torch.equal(back.scale, tensors.scale)
    assert torch.equal(dequantize(panels), dequantize(tensors))
    with pytest.raises(ValueError, match="multiple of 16"):
        to_panels(quantize(torch.randn(40, 128), QuantScheme(bits, 32, symmetric=bits == 8)))


def _fp16_exact(tensors: QuantizedTensors) -> QuantizedTensors:
    """The same weight with its scales (and mins) rounded to fp16 numbers, kept in fp32 (as a GGUF
    Q4_1 / Q8_0 file's are)."""
    low = None if tensors.min is None else tensors.min.half().float()
    return QuantizedTensors(tensors.qweight, tensors.scale.half().float(), low, tensors.bits, tensors.group)


@pytest.mark.parametrize("scheme", [*SCHEMES, QuantScheme(8, 16)], ids=lambda s: s.name)
def test_panels_keep_scales_in_fp16_exactly_where_every_one_is_an_fp16_number(scheme: QuantScheme) -> None:
    torch.manual_seed(3)
    quantized = quantize(torch.randn(32, 128), scheme)  # scales (and mins) rounded to fp16 numbers
    assert to_panels(quantized).scale.dtype == torch.float16
    nudged = quantized.scale * (1 + 2**-20)  # no longer fp16 numbers
    tensors = QuantizedTensors(quantized.qweight, nudged, quantized.min, quantized.bits, quantized.group)
    assert to_panels(tensors).scale.dtype == torch.float32
    exact = _fp16_exact(tensors)
    panels = to_panels(exact)
    assert panels.scale.dtype == torch.float16 and (panels.min is None or panels.min.dtype == torch.float16)
    back = from_panels(panels)
    assert back.scale.dtype == torch.float32 and torch.equal(back.scale, exact.scale)
    assert torch.equal(dequantize(panels), dequantize(exact))
    if exact.min is not None:  # one min beyond fp16's range keeps the weight's scales in fp32
        exact.min[3, 0] = 1e5
        assert to_panels(exact).scale.dtype == torch.float32 and to_panels(exact).min.dtype == torch.float32


def test_activation_quantization_keeps_each_block_to_a_508th_of_its_step() -> None:
    """Two int8 passes: hi = round(x / s) with s = absmax / 127, then the residual in 254ths of s."""
    x = torch.tensor([[0.0, 0.3, -2.54, 0.5, 0.0, 0.0, 0.0, 0.0], [0.31, 1.0, -0.004, 0.2, 0, 0, 0, 0]])
    step = 2.54 / 127
    first_pass = torch.tensor([[0.0, 15 * step, -2.54, 25 * step]])  # 0.3 / step = 15.0: no residual
    got = fake_quantize_activations(x, 4)
    torch.testing.assert_close(got[:1, :4], first_pass)
    absmax = torch.tensor([[2.54, 0.0], [1.0, 0.0]])  # per block of 4
    fine = (absmax / 127 / 254).repeat_interleave(4, dim=1)
    assert ((got - x).abs() <= fine / 2 + 1e-7).all()
    hi_only = torch.round(x[1, :4] / (1.0 / 127)) * (1.0 / 127)
    assert (got[1, :4] - x[1, :4]).abs().sum() < (hi_only - x[1, :4]).abs().sum() / 100
    one_pass = fake_quantize_activations(x, 4, passes=1)  # hi alone, to half a step
    torch.testing.assert_close(one_pass[1, :4], hi_only)
    assert ((one_pass - x).abs() <= (absmax / 127 / 2).repeat_interleave(4, dim=1) + 1e-7).all()
    assert activation_block(64, 256) == 64 and activation_block(256, 256) == 128 and activation_block(160, 160) == 32


needs_int8_dots = pytest.mark.skipif(
    not int8_dot_products(), reason="needs AVX2 or AVX512-VNNI (the panels layout's kernel)"
)


@needs_int8_dots
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("passes", [2, 1])
def test_panels_kernel_equals_linear_on_the_dequantized_activations_and_weight(
    scheme: QuantScheme, rows: int, dtype: torch.dtype, passes: int
) -> None:
    """N = 80: two pairs of panels and one single; rows: whole register tiles of 4 (and AMX tiles of
    8) and remainders; activations in two int8 passes or one."""
    torch.manual_seed(rows)
    w, x, bias = torch.randn(80, 256), torch.randn(rows, 256).to(dtype), torch.randn(80)
    x[0, :32] = 0.0  # an all-zero block
    tensors = dataclasses.replace(to_panels(quantize(w, scheme)), activation_passes=passes)
    x_seen = fake_quantize_activations(x, activation_block(tensors.group, 256), passes)
    expected = F.linear(x_seen, dequantize(tensors), bias)
    got = quantized_linear(x, tensors, bias.to(dtype))
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * 4)


@needs_int8_dots
@pytest.mark.parametrize("scheme", [*SCHEMES, QuantScheme(8, 16)], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("passes", [2, 1])
def test_panels_rows_in_a_batch_are_the_bits_of_each_row_alone(
    scheme: QuantScheme, dtype: torch.dtype, passes: int
) -> None:
    """A row's result does not depend on the rows beside it (speculative verification and batched
    greedy decoding rely on it): with AMX (int8_dot_tiles) batches of a few rows on run in tiles of
    8 rows, one row alone runs the vector path; both join the same exact integer sums the same way.
    N = 48: a pair of panels and a single; 19 rows: two whole tiles and a part; K = 384: blocks of
    16 ... 128 and per-channel int8's 128. With one activation pass, every row runs the vector path."""
    torch.manual_seed(len(scheme.name))
    w, x, bias = torch.randn(48, 384), torch.randn(19, 384).to(dtype), torch.randn(48)
    x[3, 64:192] = 0.0  # all-zero blocks
    x[7] *= 1e3  # a row of another scale beside the others
    tensors = dataclasses.replace(to_panels(quantize(w, scheme)), activation_passes=passes)
    batch = quantized_linear(x, tensors, bias.to(dtype))
    for rows in (range(19), range(2, 11)):  # every row against the batch; a batch of 9 from row 2
        alone = torch.cat([quantized_linear(x[i : i + 1], tensors, bias.to(dtype)) for i in rows])
        part = quantized_linear(x[rows.start : rows.stop], tensors, bias.to(dtype))
        assert torch.equal(batch[rows.start : rows.stop], alone) and torch.equal(part, alone)


@needs_int8_dots
@pytest.mark.parametrize("scheme", [*SCHEMES, QuantScheme(8, 16)], ids=lambda s: s.name)
@pytest.mark.parametrize("rows", [1, 6, 19, PANELS_MAX_ROWS + 1])
def test_panels_with_fp16_scales_give_the_bits_of_the_same_scales_in_fp32(scheme: QuantScheme, rows: int) -> None:
    """fp16 scales only shorten the stream: vector path, tiles and the dequantized path beyond
    PANELS_MAX_ROWS give the same bits as with the same values in fp32."""
    torch.manual_seed(rows)
    w, x = torch.randn(48, 256), torch.randn(rows, 256).bfloat16()
    half = to_panels(_fp16_exact(quantize(w, scheme)))
    assert half.scale.dtype == torch.float16
    low = None if half.min is None else half.min.float()
    full = QuantizedTensors(half.qweight, half.scale.float(), low, half.bits, half.group)
    assert torch.equal(quantized_linear(x, half), quantized_linear(x, full))


@needs_int8_dots
def test_fp16_scales_are_refused_outside_the_panels_layout_and_beside_fp32_mins() -> None:
    kernels = load_cpu_kernels()
    tensors = _fp16_exact(quantize(torch.randn(32, 64), QuantScheme(4, 32, symmetric=False)))
    x = torch.randn(1, 64)
    assert tensors.min is not None
    with pytest.raises(RuntimeError, match="panels layout: fp32 or fp16"):
        kernels.quantized_linear(x, tensors.qweight, tensors.scale.half(), tensors.min.half(), 4, 32, None, 6)
    panels = to_panels(tensors)
    assert panels.min is not None
    with pytest.raises(RuntimeError, match="the dtype and size of scale"):
        kernels.quantized_linear(x, panels.qweight, panels.scale, panels.min.float(), 4, 32, None, 6)


PRODUCTS_OF_SAVED_OPERANDS = """
import sys, torch
from tokenmill.kernels.quant_linear import int8_dot_isa, quantized_linear
cases = torch.load(sys.argv[1], weights_only=False)
torch.save({"isa": int8_dot_isa(), "out": [quantized_linear(x, w, bias) for w, x, bias in cases]}, sys.argv[2])
"""


@pytest.mark.skipif(
    int8_dot_isa() != "avx512-vnni", reason="compares the AVX2 build with the AVX512-VNNI build this CPU makes"
)
def test_the_avx2_build_gives_the_bits_of_the_avx512_vnni_build(tmp_path: Path) -> None:
    """The kernels built for AVX2 alone (``TOKENMILL_CPU_MARCH=x86-64-v3``: quant_int16_dot.cpp, in a
    process of their own) multiply panels-layout weights with the same bits as this CPU's
    AVX512-VNNI build (and AMX tiles, where it has them): int8 (per channel, groups of 32 and 16)
    and int4 (both kinds, fp32 and fp16 scales), fp32 and bf16 rows, 1 to past a 192-row chunk,
    activations in two passes or one."""
    torch.manual_seed(11)
    weights = [
        to_panels(quantize(torch.randn(48, 512), scheme))
        for scheme in (QuantScheme(8), QuantScheme(8, 32), QuantScheme(8, 16), *SCHEMES[2:])
    ]
    weights.append(to_panels(_fp16_exact(quantize(torch.randn(32, 512), QuantScheme(4, 32, symmetric=False)))))
    weights += [dataclasses.replace(w, activation_passes=1) for w in weights]
    cases = []
    for w in weights:
        for rows in (1, 2, 3, 7, 200):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, 512).to(dtype) * 4
                x[0, :64] = 0.0  # all-zero blocks
                cases.append((w, x, torch.randn(w.shape[0]).to(dtype)))
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "TOKENMILL_CPU_MARCH": "x86-64-v3"}
    command = [sys.executable, "-c", PRODUCTS_OF_SAVED_OPERANDS, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")]
    subprocess.run(command, env=env, check=True, timeout=900)
    theirs = torch.load(tmp_path / "out.pt", weights_only=False)
    assert theirs["isa"] == "avx2"
    for (w, x, bias), out in zip(cases, theirs["out"], strict=True):
        assert torch.equal(quantized_linear(x, w, bias), out), (w.bits, w.group, w.activation_passes, x.shape, x.dtype)


def test_int8_tiles_are_used_where_the_cpu_has_them() -> None:
    """The AMX path is on wherever the CPU lists AMX-INT8 (Linux grants tiles on request)."""
    has_amx = "amx_int8" in cpu_flags() and load_cpu_kernels() is not None and int8_dot_products()
    assert int8_dot_tiles() == has_amx


@needs_int8_dots
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("passes, most_rows", [(2, PANELS_MAX_ROWS), (1, ONE_PASS_PANELS_MAX_ROWS)])
def test_panels_beyond_the_kernels_rows_are_linear_on_the_dequantized_weight(
    bits: int, passes: int, most_rows: int
) -> None:
    """More rows than the limit for the weight's activation passes: the weight is dequantized for
    oneDNN, activations as they are; up to it, they are quantized."""
    w, x = torch.randn(32, 64), torch.randn(most_rows + 3, 64).bfloat16()
    tensors = dataclasses.replace(
        to_panels(quantize(w, QuantScheme(bits, 32, symmetric=bits == 8))), activation_passes=passes
    )
    expected = F.linear(x, dequantize(tensors, torch.bfloat16))
    assert torch.equal(quantized_linear(x, tensors), expected)
    assert not torch.equal(quantized_linear(x[:most_rows], tensors), expected[:most_rows])
