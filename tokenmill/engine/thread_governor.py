"""ThreadGovernor: the engine's CPU threads, fitted to the CPUs that other work leaves free.

torch runs every parallel op of a step (oneDNN products, tokenmill's C++ kernels) as an OpenMP
region over its threads, and a step holds hundreds of short regions; each ends in a barrier that
waits for every thread. When another process (or the server's own threads) takes a CPU from one of
the engine's threads, every region waits for a scheduler slice, and the waiting threads spin on
the CPUs the others need. One thread fewer than the CPUs in use beside it avoids the stall at its
root: the remaining threads each have a CPU.

The governor runs on the engine's loop thread, between steps. At most every ``interval_s`` it
samples the foreign load (:class:`~tokenmill.cpu_load.ForeignLoad`, in CPUs) and sets the threads to
the usable CPUs less the foreign load, rounded so that a quarter CPU or more of foreign work gives
up one thread; at least one. It drops threads at once and adds them back only when two samples in
a row call for it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch

from tokenmill.config import EngineConfig
from tokenmill.cpu_load import ForeignLoad
from tokenmill.hardware import usable_cpus

THRESHOLD_CPUS = 0.25
"""Foreign load (in CPUs) from which a thread is given up: ``threads = usable - ceil(load - 0.25)``."""


def threads_for(usable: int, foreign: float) -> int:
    """Threads for ``usable`` CPUs with ``foreign`` CPUs' worth of other work running: at least 1."""
    return max(1, min(usable, usable - math.ceil(foreign - THRESHOLD_CPUS)))


class ThreadGovernor:
    """Keeps ``torch``'s intra-op threads at :func:`threads_for` the measured load. Loop thread only."""

    def __init__(
        self,
        usable: int,
        sample_load: Callable[[], float | None],
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.usable = usable
        self.threads = usable
        self.changes = 0  # how often the thread count moved (for stats)
        self._sample_load = sample_load
        self._interval_s = interval_s
        self._clock = clock
        self._set_threads = set_threads
        self._next_sample = clock()
        self._raise_pending = False  # the last sample called for more threads
        set_threads(usable)

    def tick(self) -> None:
        """Between steps: re-measure when the interval has passed, and move the thread count."""
        now = self._clock()
        if now < self._next_sample:
            return
        self._next_sample = now + self._interval_s
        foreign = self._sample_load()
        if foreign is None:
            return
        target = threads_for(self.usable, foreign)
        if target > self.threads and not self._raise_pending:
            self._raise_pending = True  # wait for a second sample before adding threads back
            return
        self._raise_pending = False
        if target != self.threads:
            self.threads = target
            self.changes += 1
            self._set_threads(target)


def engine_thread_governor(
    config: EngineConfig, device: torch.device, engine_thread: threading.Thread
) -> ThreadGovernor | None:
    """The CPU threads of an engine whose loop thread is ``engine_thread`` (call it on that thread):
    a governor for ``cpu_threads=0`` on CPU at one rank; else None, after fixing ``cpu_threads``
    threads where given (tensor parallelism splits the CPUs between its ranks itself)."""
    if device.type != "cpu" or config.tensor_parallel_size > 1:
        return None
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
        return None
    return ThreadGovernor(usable_cpus(), ForeignLoad(engine_thread).sample)
