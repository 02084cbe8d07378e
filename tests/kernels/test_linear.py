"""tokenmill's linear (C++ skinny/panel kernels or oneDNN on fp32 CPU, F.linear elsewhere) equals F.linear."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import linear as linear_module
from tokenmill.kernels.linear import PANEL_MAX_ROWS, SKINNY_MAX_ROWS, Linear, linear

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")


@pytest.mark.parametrize("rows", [0, 1, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 64, PANEL_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [96, 101])  # 101: not a multiple of the 8-wide vectors
def test_matches_f_linear(rows: int, bias: bool, in_features: int) -> None:
    torch.manual_seed(rows)
    weight, b = torch.randn(303, in_features), torch.randn(303) if bias else None  # 303: not a multiple of 4 or 16
    x = torch.randn(rows, in_features)
    assert torch.allclose(linear(x, weight, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, max(rows // 2, 1), 2 * in_features)[..., ::2]  # 3-d and not contiguous
    assert torch.allclose(linear(x3, weight, b), F.linear(x3, weight, b), atol=1e-4, rtol=1e-5)


def _kernels() -> Any:
    kernels = linear_module.load_cpu_kernels()
    assert kernels is not None, "a C++ compiler is present, so the kernels must build (see the log)"
    return kernels


@needs_compiler
@pytest.mark.parametrize("in_features", [7, 64, 1543])  # 1543 > two packed k blocks of 768, odd
@pytest.mark.parametrize("out_features", [5, 16, 33])  # a partial panel, one panel, two and a partial
def test_panel_kernel_every_tile_height(in_features: int, out_features: int) -> None:
    torch.manual_seed(in_features + out_features)
    weight, b = torch.randn(out_features, in_features), torch.randn(out_features)
    for rows in range(1, 14):  # 1-6-row register tiles, alone and after full 6-row tiles
        x = torch.randn(rows, in_features)
        out = _kernels().panel_linear(x, weight, b)
        assert torch.allclose(out, F.linear(x, weight, b), atol=1e-4, rtol=1e-5), rows


@needs_compiler
def test_kernel_choice_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = _kernels()
    used: list[str] = []

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            used.append(name)
            return getattr(kernels, name)

    monkeypatch.setattr(linear_module, "load_cpu_kernels", Recorder)
    weight = torch.randn(40, 16)
    for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1):
        linear(torch.randn(rows, 16), weight)
    assert used == ["skinny_linear", "skinny_linear", "panel_linear", "panel_linear"]  # then oneDNN


def test_other_dtypes_and_module() -> None:
    weight = torch.randn(40, 16).bfloat16()
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight))  # bf16 of more than one row: F.linear
    module = Linear(16, 40)
    assert set(dict(module.named_parameters())) == {"weight", "bias"}
    with torch.inference_mode():
        assert torch.allclose(module(x.float()), F.linear(x.float(), module.weight, module.bias), atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("k_dim", [33, 64, 100])  # a masked last step of the AVX512-BF16 path, or none
def test_skinny_bf16_is_fp32_math_rounded_once(rows: int, k_dim: int) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(70, k_dim).bfloat16(), torch.randn(70).bfloat16()
    x = torch.randn(rows, k_dim).bfloat16()
    out = _kernels().skinny_linear(x, weight, bias)
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected.bfloat16().float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_follows_in_place_weight_changes(dtype: torch.dtype) -> None:
    """Where the module keeps a blocked copy of its weight for oneDNN, an in-place change of the
    weight (loading, a weight update) is seen by the next forward."""
    torch.manual_seed(0)
    module = Linear(32, 48).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 2, 8, 200):
        x = torch.randn(rows, 32).to(dtype)
        with torch.inference_mode():
            before = module(x)
        with torch.no_grad():
            module.weight.mul_(-2.0)
        with torch.inference_mode():
            after = module(x)
        expected = F.linear(x.float(), module.weight.float(), module.bias.float())
        assert torch.allclose(after.float(), expected, atol=tol, rtol=tol)
        assert not torch.allclose(after, before)


def test_module_follows_dtype_changes_and_swapped_weights() -> None:
    """``Module.to`` and ``weight.data = ...`` replace the weight without moving its version
    counter; a blocked copy of the old weight must not be used."""
    torch.manual_seed(1)
    module = Linear(32, 48, bias=False)
    x = torch.randn(8, 32)
    with torch.inference_mode():
        module(x)
    module.to(torch.bfloat16)
    with torch.inference_mode():
        out = module(x.bfloat16())
    assert torch.allclose(out.float(), F.linear(x.bfloat16().float(), module.weight.float()), atol=2e-2, rtol=2e-2)
    module.to(torch.float32)
    with torch.inference_mode():
        module(x)
    module.weight.data = torch.randn(48, 32)
    with torch.inference_mode():
        assert torch.allclose(module(x), F.linear(x, module.weight), atol=1e-5)
