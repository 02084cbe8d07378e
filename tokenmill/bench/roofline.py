"""The machine's measured limits: fp32 matmul GFLOP/s, memory copy and read GB/s (median of repeats).
Each probe runs on a short-lived thread of its own (``own_thread.py`` says why)."""

from __future__ import annotations

import statistics
import time

import torch

from tokenmill.bench.own_thread import on_own_thread


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@on_own_thread
def matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b)) / 1e9


@on_own_thread
def copy_gbps(n_bytes: int = 256 * 1024**2) -> float:
    src = torch.empty(n_bytes // 4)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * n_bytes / _median_seconds(lambda: dst.copy_(src)) / 1e9  # read + write


@on_own_thread
def read_gbps(n_bytes: int = 256 * 1024**2) -> float:
    """Streaming read rate (a sum over a buffer far larger than the caches): what a bandwidth-bound
    weight product can reach, where the copy rate also counts the writes."""
    src = torch.empty(n_bytes // 4)
    src.fill_(1.0)
    return n_bytes / _median_seconds(lambda: src.sum()) / 1e9
