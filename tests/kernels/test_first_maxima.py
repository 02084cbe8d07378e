"""The greedy pick's C++ kernel (``first_maxima.cpp``) against torch's ``max(dim=-1)`` indices.

Skipped only where no C++ compiler exists (the kernel is then never used)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.first_maxima import first_maxima

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")


def torch_first_maxima(logits: torch.Tensor) -> list[int]:
    return logits.float().max(dim=-1).indices.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_on_ties_infinities_and_nans(dtype: torch.dtype) -> None:
    assert load_cpu_kernels() is not None, "a C++ compiler is present, so the kernels must build (see the log)"
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        rows = int(torch.randint(1, 9, (), generator=generator))
        vocab = int(torch.randint(1, 70, (), generator=generator))  # vector chunks and a tail of 0-7
        logits = torch.randn(rows, vocab, generator=generator)
        if trial % 2:
            logits = logits.round()  # many ties: the first one must win
        if trial % 5 == 0:
            logits[0] = float("-inf")  # a grammar's dead end
        if trial % 7 == 0:
            logits[-1, int(torch.randint(0, vocab, (), generator=generator))] = float("nan")
            logits[-1, -1] = float("nan")
        if trial % 11 == 0:
            logits[0, int(torch.randint(0, vocab, (), generator=generator))] = float("inf")
        logits = logits.to(dtype)
        assert first_maxima(logits) == torch_first_maxima(logits), (trial, logits)


def test_a_vocabulary_sized_batch_and_a_strided_view() -> None:
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(1))
    logits[3, 17] = logits[3, 40000] = logits[3].max() + 1  # a tie far apart
    assert first_maxima(logits) == torch_first_maxima(logits)
    view = logits[::2, :1000]
    assert first_maxima(view) == torch_first_maxima(view)
