"""The fused C++ ops of ``kernels/fused.py`` against their torch implementations (the reference).

Skipped only where no C++ compiler exists (the kernels are then never used)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tokenmill.kernels import fused
from tokenmill.kernels.cpu import load_cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")

ROWS = [0, 1, 5, 130]


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch):
    """Call a fused op with the kernels switched off (its torch implementation)."""

    def call(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(fused, "_kernels", lambda x: None)
            return fn(*args)

    assert load_cpu_kernels() is not None, "a C++ compiler is present, so the kernels must build (see the log)"
    return call


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-6) -> bool:
    return (
        a.shape == b.shape and a.dtype == b.dtype and (a - b).abs().max().item() <= tol
        if a.numel()
        else a.shape == b.shape
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [64, 77])
def test_rms_norm(reference, rows: int, dim: int) -> None:
    x, w = torch.randn(rows, dim) * 3, torch.randn(dim)
    assert close(fused.rms_norm(x, w, 1e-5), reference(fused.rms_norm, x, w, 1e-5))
    assert close(fused.rms_norm(x.t().contiguous().t(), w, 1e-5), reference(fused.rms_norm, x, w, 1e-5))


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_residual(reference, rows: int) -> None:
    x, residual, w = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    expected_out, expected_sum = reference(fused.add_rms_norm, x, residual.clone(), w, 1e-6)
    owned = residual.clone()
    out, total = fused.add_rms_norm(x, owned, w, 1e-6)
    assert close(out, expected_out) and close(total, expected_sum)
    assert total is owned  # summed in place: no new residual tensor per layer
    assert close(expected_sum, residual + x)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [2 * 64, 2 * 83])
def test_silu_and_mul(reference, rows: int, width: int) -> None:
    gate_up = torch.randn(rows, width) * 6
    gate_up[:, 0] = 100.0  # exp range clamps: silu(x) -> x and silu(-x) -> 0
    gate_up[:, 1] = -100.0
    assert close(fused.silu_and_mul(gate_up), reference(fused.silu_and_mul, gate_up), tol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (6, 6, 24), (3, 1, 10)])
def test_rotary_split_qkv(reference, rows: int, heads: int, kv_heads: int, dim: int) -> None:
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(rows, dim // 2) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = fused.rotary_split_qkv(qkv, cos, sin, heads, kv_heads, dim)
    want = reference(fused.rotary_split_qkv, qkv, cos, sin, heads, kv_heads, dim)
    for g, w in zip(got, want):
        assert g.is_contiguous() and close(g, w)
    assert got[0].shape == (rows, heads, dim) and got[2].shape == (rows, kv_heads, dim)


def close_bf16(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> bool:
    """bf16 kernel output vs the torch bf16 chain: within two bf16 steps (2**-7 relative), plus
    ``atol`` where torch's per-op roundings of larger intermediates (the RoPE products, the norm's
    scaled row) can move a result that cancels or shrinks by more than its own steps."""
    return (
        ours.dtype == ref.dtype == torch.bfloat16
        and ours.shape == ref.shape
        and torch.allclose(ours.float(), ref.float(), rtol=2**-7, atol=atol)
    )


@pytest.mark.parametrize("rows", [1, 5, 130])
def test_bf16_norms(reference, rows: int) -> None:
    x, residual, w = (
        (torch.randn(rows, 96) * 3).bfloat16(),
        torch.randn(rows, 96).bfloat16(),
        torch.randn(96).bfloat16(),
    )
    assert close_bf16(fused.rms_norm(x, w, 1e-5), reference(fused.rms_norm, x, w, 1e-5), atol=1e-6)
    expected_out, expected_sum = reference(fused.add_rms_norm, x, residual.clone(), w, 1e-6)
    owned = residual.clone()
    out, total = fused.add_rms_norm(x, owned, w, 1e-6)
    assert total is owned and torch.equal(total, expected_sum)  # one bf16 add: identical roundings
    assert close_bf16(out, expected_out, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 130])
def test_bf16_silu_and_mul(reference, rows: int) -> None:
    gate_up = (torch.randn(rows, 2 * 83) * 6).bfloat16()
    assert close_bf16(fused.silu_and_mul(gate_up), reference(fused.silu_and_mul, gate_up), atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 130])
def test_bf16_rotary_split_qkv(reference, rows: int) -> None:
    heads, kv_heads, dim = 4, 2, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).bfloat16()
    angles = torch.rand(rows, dim // 2) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    got = fused.rotary_split_qkv(qkv, cos, sin, heads, kv_heads, dim)
    want = reference(fused.rotary_split_qkv, qkv, cos, sin, heads, kv_heads, dim)
    for g, w in zip(got, want):
        assert g.is_contiguous() and close_bf16(g, w, atol=2 * 2**-8 * 4)  # terms up to ~4: two of their steps
    assert torch.equal(got[2], want[2])  # values are copied, not computed
