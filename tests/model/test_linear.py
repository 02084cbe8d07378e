"""tokenmill's linear (oneDNN on fp32 CPU, F.linear elsewhere) equals F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.linear import Linear, linear


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight, b = torch.randn(300, 96), torch.randn(300) if bias else None
    x = torch.randn(rows, 96)
    assert torch.allclose(linear(x, weight, b), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 5, 192)[..., ::2]  # 3-d and not contiguous
    assert torch.allclose(linear(x3, weight, b), F.linear(x3, weight, b), atol=1e-5, rtol=1e-5)


def test_other_dtypes_and_module() -> None:
    weight = torch.randn(40, 16).bfloat16()
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight))  # bf16 goes to F.linear
    module = Linear(16, 40)
    assert set(dict(module.named_parameters())) == {"weight", "bias"}
    with torch.inference_mode():
        assert torch.allclose(module(x.float()), F.linear(x.float(), module.weight, module.bias), atol=1e-5)
