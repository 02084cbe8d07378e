"""Small statistics helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def summarize(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """mean / p50 / p99 of ``values`` times ``scale`` (e.g. 1000 for ms); zeros when empty."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean": statistics.fmean(ordered) * scale,
        "p50": statistics.median(ordered) * scale,
        "p99": p99 * scale,
    }


class Timer:
    """Wall seconds of every call of a wrapped function."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        return timed
