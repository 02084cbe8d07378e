"""Reliability tests run the engine with one intra-op torch thread.

On a busy two-core machine, two OpenMP threads spin-wait for each other and a tiny model's
matmul can take milliseconds instead of microseconds; these tests measure time-bounded
workloads (soak, fuzz), not kernel speed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
