"""CommandQueue: how other threads reach the engine's loop thread.

A command is a ``run`` callable the loop executes between steps, paired with a ``cancel`` callable
that answers its caller instead if the loop ends first. Once :meth:`CommandQueue.close` has run
(the loop ended), every later :meth:`~CommandQueue.put` raises :class:`EngineDeadError` and every
command still queued is cancelled, so no caller waits on a loop that is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger("tokenmill.engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class CommandQueue:
    """Commands for the loop thread; ``put`` from any thread, ``drain`` and ``close`` on the loop thread."""

    def __init__(self, dead_message: Callable[[], str]) -> None:
        self._dead_message = dead_message  # why the loop is gone, for EngineDeadError
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._closing = threading.Lock()  # orders every put against the loop's final drain
        self._closed = False  # set under _closing when the loop ends: no command is queued after it

    def put(self, run: Callable[[], None], cancel: Callable[[], None]) -> None:
        """Queue ``run`` for the loop thread, or raise EngineDeadError once the loop has ended. A
        command still queued when the loop ends runs ``cancel`` instead, so every command is answered."""
        with self._closing:
            if self._closed:
                raise EngineDeadError(self._dead_message())
            self._commands.put(lambda: cancel() if self._closed else run())

    def __len__(self) -> int:
        """Commands waiting for the loop (a snapshot: other threads may be adding)."""
        return self._commands.qsize()

    def wake(self) -> None:
        """Wake a loop waiting in :meth:`drain` (a no-op command)."""
        self._commands.put(lambda: None)

    def drain(self, block: bool) -> None:
        """Run every queued command; with ``block``, first wait up to 50 ms for one to arrive."""
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """The loop ended: refuse later commands and cancel the queued ones."""
        with self._closing:
            self._closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                logger.exception("cancelling a queued command failed")
