"""LogThrottle: lets one of a kind of repeated server log message through per interval.

Some messages repeat as fast as a client or the system can provoke them: asyncio logs
"socket.accept() out of system resource" with a traceback on every accept retry while the
process is out of file descriptors (and "socket.send() raised exception." for each dropped
connection written to), and uvicorn warns on every malformed request and every
request over the connection cap. The throttle lets the first of each kind through, drops the
rest for ``interval_s``, and notes on the next one it lets through how many it dropped.
"""

from __future__ import annotations

import logging
import math
import threading
import time

DEFAULT_INTERVAL_S = 10.0

# (logger name, message start): each pair is one kind of message, throttled on its own
THROTTLED = (
    ("asyncio", "socket.accept() out of system resource"),
    ("asyncio", "socket.send() raised exception."),  # writes to a connection its client has dropped
    ("uvicorn.error", "Invalid HTTP request received."),
    ("uvicorn.error", "Exceeded concurrency limit."),
)


class LogThrottle(logging.Filter):
    """A filter for one logger: of the messages starting with one of ``prefixes``, one per kind per ``interval_s``."""

    def __init__(self, prefixes: tuple[str, ...], interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last_passed: dict[str, float] = {}  # prefix -> when one last went through
        self._suppressed: dict[str, int] = {}  # prefix -> dropped since then

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        prefix = next((p for p in self.prefixes if message.startswith(p)), None)
        if prefix is None:
            return True
        now = time.monotonic()
        with self._lock:
            since_last = now - self._last_passed.get(prefix, -math.inf)
            if since_last < self.interval_s:
                self._suppressed[prefix] = self._suppressed.get(prefix, 0) + 1
                return False
            self._last_passed[prefix] = now
            suppressed = self._suppressed.pop(prefix, 0)
        if suppressed:
            record.msg = f"{message} [{suppressed} more like this in the last {since_last:.0f} s were suppressed]"
            record.args = ()
        return True


def install_log_throttle(interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Throttle the messages in :data:`THROTTLED` on their loggers (once per logger; later calls do nothing)."""
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, prefix in THROTTLED:
        by_logger[name] = (*by_logger.get(name, ()), prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, LogThrottle) for existing in logger.filters):
            logger.addFilter(LogThrottle(prefixes, interval_s))
