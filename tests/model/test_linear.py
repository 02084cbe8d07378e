"""tokenmill's linear (skinny C++ kernel / oneDNN on fp32 CPU, F.linear elsewhere) equals F.linear."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model import linear as linear_module
from tokenmill.model.linear import SKINNY_MAX_ROWS, Linear, linear


@pytest.mark.parametrize("rows", [0, 1, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [96, 101])  # 101: not a multiple of the 8-wide vectors
def test_matches_f_linear(rows: int, bias: bool, in_features: int) -> None:
    torch.manual_seed(rows)
    weight, b = torch.randn(303, in_features), torch.randn(303) if bias else None  # 303: not a multiple of 4
    x = torch.randn(rows, in_features)
    assert torch.allclose(linear(x, weight, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, max(rows // 2, 1), 2 * in_features)[..., ::2]  # 3-d and not contiguous
    assert torch.allclose(linear(x3, weight, b), F.linear(x3, weight, b), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")
def test_skinny_kernel_is_used_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = linear_module.load_cpu_kernels()
    assert kernels is not None, "a C++ compiler is present, so the kernels must build (see the log)"
    calls = []
    monkeypatch.setattr(linear_module, "load_cpu_kernels", lambda: calls.append(1) or kernels)
    weight = torch.randn(40, 16)
    linear(torch.randn(SKINNY_MAX_ROWS, 16), weight)
    linear(torch.randn(SKINNY_MAX_ROWS + 1, 16), weight)
    assert len(calls) == 1


def test_other_dtypes_and_module() -> None:
    weight = torch.randn(40, 16).bfloat16()
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight))  # bf16 goes to F.linear
    module = Linear(16, 40)
    assert set(dict(module.named_parameters())) == {"weight", "bias"}
    with torch.inference_mode():
        assert torch.allclose(module(x.float()), F.linear(x.float(), module.weight, module.bias), atol=1e-5)
