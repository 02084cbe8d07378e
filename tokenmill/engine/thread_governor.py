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
up one thread; at least one. It drops threads at once and adds them back only once samples in a row
have called for it over at least two intervals of work (two samples, or one long step's). Only
load measured while the engine works counts: while the loop waits for work (from
:meth:`ThreadGovernor.rest` to the next tick) the sampling window is paused, its clock included
(what runs beside an idle engine, such as a client preparing its requests, says little about what
will run beside its steps).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from tokenmill.config import EngineConfig
from tokenmill.cpu_load import ForeignLoad
from tokenmill.hardware import usable_cpus

THRESHOLD_CPUS = 0.25
"""Foreign load (in CPUs) from which a thread is given up: ``threads = usable - ceil(load - 0.25)``."""


def threads_for(usable: int, foreign: float) -> int:
    """Threads for ``usable`` CPUs with ``foreign`` CPUs' worth of other work running: at least 1."""
    return max(1, min(usable, usable - math.ceil(foreign - THRESHOLD_CPUS)))


class LoadMeter(Protocol):
    """Foreign load in CPUs over a window that can be paused (see :class:`~tokenmill.cpu_load.ForeignLoad`)."""

    def sample(self) -> float | None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class ThreadGovernor:
    """Keeps ``torch``'s intra-op threads at :func:`threads_for` the measured load. Loop thread only."""

    def __init__(
        self,
        usable: int,
        load: LoadMeter,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.usable = usable
        self.threads = usable
        self.changes = 0  # how often the thread count moved (for stats)
        self._load = load
        self._interval_s = interval_s
        self._clock = clock
        self._set_threads = set_threads
        self._window_start = clock()  # the current sampling window opened here (moved on by rests)
        self._raise_evidence_s = 0.0  # work time of the samples in a row that called for more threads
        self._rest_started: float | None = None  # when the loop began waiting for work, if it is
        load.sample()  # opens the first window
        set_threads(usable)

    def rest(self) -> None:
        """The loop is about to wait for work: pause the sampling window until the next :meth:`tick`."""
        if self._rest_started is None:
            self._rest_started = self._clock()
            self._load.pause()

    def tick(self) -> None:
        """Between steps: re-measure when the interval has passed, and move the thread count."""
        now = self._clock()
        if self._rest_started is not None:
            self._load.resume()
            self._window_start += now - self._rest_started
            self._rest_started = None
        window_s = now - self._window_start
        if window_s < self._interval_s:
            return
        self._window_start = now
        foreign = self._load.sample()
        if foreign is None:
            return
        target = threads_for(self.usable, foreign)
        if target > self.threads:
            self._raise_evidence_s += window_s
            if self._raise_evidence_s < 2 * self._interval_s:
                return
        self._raise_evidence_s = 0.0
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
    return ThreadGovernor(usable_cpus(), ForeignLoad(engine_thread))
