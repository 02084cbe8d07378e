"""Run parallel torch work of a benchmark's own (model creation, machine probes) on a short-lived
thread, so the caller's thread keeps no OpenMP team.

torch's OpenMP (libgomp) keeps a team of worker threads for every thread that ran a parallel op,
and once it manages more threads than CPUs it barely spin-waits, which slows the engine's loop
thread (see docs/performance.md); a thread that exits takes its team along.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def on_own_thread(work: Callable[P, T]) -> Callable[P, T]:
    """``work`` run on a new thread that ends with it; its exception re-raised in the caller."""

    @functools.wraps(work)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        outcome: list = []

        def target() -> None:
            try:
                outcome.append((True, work(*args, **kwargs)))
            except BaseException as exc:  # handed to the caller
                outcome.append((False, exc))

        thread = threading.Thread(target=target, name=f"tokenmill-{work.__name__}")
        thread.start()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    return run
