"""The machine's measured limits: fp32 matmul GFLOP/s, memory copy and read GB/s (median of repeats).

Each probe runs on a short-lived thread of its own: torch's OpenMP (libgomp) keeps a team of worker
threads for every thread that ran a parallel op, and once it manages more threads than CPUs it
barely spin-waits, which slows the engine's loop thread; a thread that exits takes its team along.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def _on_own_thread(probe: Callable[..., T]) -> Callable[..., T]:
    """``probe`` run on a new thread that ends with it (its OpenMP team ends too)."""

    @functools.wraps(probe)
    def run(*args: object, **kwargs: object) -> T:
        result: list[T] = []
        thread = threading.Thread(target=lambda: result.append(probe(*args, **kwargs)), name="tokenmill-probe")
        thread.start()
        thread.join()
        if not result:
            raise RuntimeError(f"probe {probe.__name__} failed (see the thread's traceback above)")
        return result[0]

    return run


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@_on_own_thread
def matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b)) / 1e9


@_on_own_thread
def copy_gbps(n_bytes: int = 256 * 1024**2) -> float:
    src = torch.empty(n_bytes // 4)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * n_bytes / _median_seconds(lambda: dst.copy_(src)) / 1e9  # read + write


@_on_own_thread
def read_gbps(n_bytes: int = 256 * 1024**2) -> float:
    """Streaming read rate (a sum over a buffer far larger than the caches): what a bandwidth-bound
    weight product can reach, where the copy rate also counts the writes."""
    src = torch.empty(n_bytes // 4)
    src.fill_(1.0)
    return n_bytes / _median_seconds(lambda: src.sum()) / 1e9
