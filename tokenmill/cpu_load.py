"""How busy the machine's CPUs are with work other than the engine's own threads (Linux ``/proc``).

:class:`ForeignLoad` samples, between two calls, the CPU time the whole machine spent busy
(``/proc/stat``) minus the CPU time of the engine's threads: this process's CPU time (every thread's,
the engine's OpenMP workers included) less that of its Python threads other than the engine's loop
thread (a server's event loop, tokenizer pool, watchdogs: they compete with the engine's workers as
any other process does). Native threads that Python does not know (a library's own pool) count as
the engine's. Work at a lower priority than the engine's (``nice`` above its own: the kernel's
``nice`` time) is left out: the scheduler hands its CPU to the engine's threads whenever they run,
so it costs them little (measured, docs/benchmarks.md, "Threads that share the machine"); an engine itself
running niced counts all of it. Where ``/proc`` is not readable, nothing is measured (``sample``
returns None).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NICE_FIELD = 1
IDLE_FIELDS = (3, 4)
"""nice, and idle and iowait, among ``/proc/stat``'s cpu fields (user nice system idle iowait irq softirq steal ...)."""


def machine_busy_seconds(niced: bool) -> float | None:
    """CPU seconds every CPU of the machine has spent busy since boot, with or without the time of
    processes at a positive ``nice`` (None: not readable)."""
    try:
        with PROC_STAT.open() as stat:
            fields = stat.readline().split()[1:9]  # the "cpu" line: all CPUs added up; guest time is in user
    except OSError:
        return None
    left_out = IDLE_FIELDS if niced else (NICE_FIELD, *IDLE_FIELDS)
    busy = sum(int(v) for i, v in enumerate(fields) if i not in left_out)
    return busy / CLOCK_TICKS


def thread_cpu_seconds(native_id: int) -> float:
    """CPU seconds one thread of this process has used (0 for a thread that has ended)."""
    try:
        text = Path(f"/proc/self/task/{native_id}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


class ForeignLoad:
    """CPUs' worth of work beside the engine, averaged over the time between consecutive
    :meth:`sample` calls that was not spent paused (:meth:`pause` .. :meth:`resume`)."""

    def __init__(self, engine_thread: threading.Thread) -> None:
        self.engine_thread = engine_thread
        self._last: tuple[float, float] | None = None  # (wall time, foreign CPU seconds) at the last sample
        self._paused_at: tuple[float, float] | None = None

    def sample(self) -> float | None:
        """Foreign CPUs busy on average since the previous call, pauses left out (None on the first
        call, or where the machine's counters cannot be read)."""
        reading, last = self._reading(), self._last
        self._last = reading
        if reading is None or last is None or reading[0] <= last[0]:
            return None
        return max(0.0, (reading[1] - last[1]) / (reading[0] - last[0]))

    def pause(self) -> None:
        """Leave out what follows, until :meth:`resume` (a second pause keeps the first's start)."""
        if self._paused_at is None:
            self._paused_at = self._reading()

    def resume(self) -> None:
        """Count again from now: the paused time and the foreign CPU time in it are dropped."""
        start, self._paused_at = self._paused_at, None
        end = self._reading()
        if start is not None and end is not None and self._last is not None:
            self._last = (self._last[0] + end[0] - start[0], self._last[1] + end[1] - start[1])

    def _reading(self) -> tuple[float, float] | None:
        """(monotonic wall time, foreign CPU seconds so far), or None where /proc is not readable."""
        busy = machine_busy_seconds(niced=os.getpriority(os.PRIO_PROCESS, 0) > 0)
        if busy is None:
            return None
        others = sum(
            thread_cpu_seconds(t.native_id)
            for t in threading.enumerate()
            if t is not self.engine_thread and t.native_id is not None
        )
        return time.monotonic(), busy - (time.process_time() - others)
