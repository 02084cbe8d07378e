"""EngineLoop: the life of the engine's one loop thread, apart from what a step does.

The thread builds the engine's parts, then runs queued commands and steps until it is shut down
or fails. Other threads reach it only through its :class:`~tokenmill.engine.commands.CommandQueue`
(:meth:`EngineLoop.call` runs a function between steps and returns its result). However the loop
ends (shutdown or death), every command and request it still holds is answered, later calls raise
:class:`~tokenmill.engine.commands.EngineDeadError`, and :meth:`EngineLoop.is_healthy` says so.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from tokenmill.engine.commands import CommandQueue, EngineDeadError

logger = logging.getLogger("tokenmill.engine")
T = TypeVar("T")

_STARTED: weakref.WeakSet[EngineLoop] = weakref.WeakSet()
"""Every loop started in this process and not yet garbage: stopped at interpreter exit."""


@atexit.register
def _stop_started_loops() -> None:
    """Stop the loops a program left running, before the interpreter finalizes: a daemon loop thread
    still polling its commands then would be frozen mid-call, which can abort the whole process
    (``std::terminate``: "terminate called without an active exception")."""
    for loop in list(_STARTED):
        loop.shutdown()


class EngineLoop(ABC):
    """Base of :class:`~tokenmill.engine.engine.Engine`: the loop thread, its commands and its health.
    Subclasses say how to build, whether there is work, what a step is and how to end."""

    def __init__(self) -> None:
        self._commands = CommandQueue(self._dead_message)
        self._stop = threading.Event()
        self._dead: str | None = None
        self._crash: str | None = None  # why the loop died, if it did (not set by a shutdown)
        self._paused = False

    def _start(self) -> None:
        """Start the loop thread and wait for its build; the build's error, if any, is raised here."""
        built: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="tokenmill-engine", daemon=True)
        self._thread.start()
        _STARTED.add(self)
        built.result()

    # ------------------------------------------------------------------ what a subclass provides
    @abstractmethod
    def _build(self) -> None:
        """Make everything the loop uses (on the loop thread)."""

    @abstractmethod
    def _has_work(self) -> bool:
        """Whether a step would do anything now."""

    @abstractmethod
    def _step(self) -> None:
        """One step; an error that escapes it kills the loop."""

    @abstractmethod
    def _answer_all(self) -> None:
        """The loop has ended after a build: give every request still held its final delta."""

    @abstractmethod
    def _release(self) -> None:
        """Free what outlives the loop (other processes), after a failed build or the loop's end."""

    @abstractmethod
    def _outside_failure(self) -> BaseException | None:
        """The error of something outside this thread the loop depends on (other ranks), if it failed."""

    @abstractmethod
    def _before_idle(self) -> None:
        """The loop is about to wait for a command: there is no runnable work."""

    # ------------------------------------------------------------------ any thread
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and self._outside_failure() is None

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its error)."""
        self._check_alive()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the caller
                future.set_exception(exc)

        self._commands.put(run, lambda: future.set_exception(EngineDeadError(self._dead_message())))
        return future.result(timeout)

    def pause_generation(self) -> None:
        """Stop scheduling steps (requests stay queued/running) until :meth:`resume_generation`."""
        self.call(lambda: setattr(self, "_paused", True))

    def resume_generation(self) -> None:
        self.call(lambda: setattr(self, "_paused", False))

    @property
    def paused(self) -> bool:
        return self._paused

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step and wait up to ``timeout`` seconds for it. Every request
        still held ends with "abort", queued calls raise EngineDeadError, and later ones raise it too."""
        self._stop.set()
        self._commands.wake()
        self._thread.join(timeout)

    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(self._dead_message())

    def _dead_message(self) -> str:
        return f"the engine loop is not running: {self._dead or 'stopped'}"

    # ------------------------------------------------------------------ the loop thread
    def _run(self, built: Future[None]) -> None:
        try:
            self._build()
        except BaseException as exc:
            self._dead = f"engine build failed: {type(exc).__name__}: {exc}"
            self._release()
            built.set_exception(exc)
            return
        built.set_result(None)
        try:
            while not self._stop.is_set():
                failure = self._outside_failure()
                if failure is not None:
                    raise failure
                working = self._has_work() and not self._paused
                if not working:
                    self._before_idle()
                self._commands.drain(block=not working)
                if self._has_work() and not self._paused:
                    self._step()
        except BaseException as exc:  # the loop itself failed: make it visible, fail everyone
            self._dead = self._crash = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
        finally:
            if self._dead is None:
                self._dead = "shut down"
            self._commands.close()
            self._answer_all()
            self._release()
