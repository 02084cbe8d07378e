"""ConnectionLimits: how long and how many connections the HTTP server keeps, and how much header it reads.

Pure settings (no server imports), so the command line derives its options from them before the
server stack loads: each field is a ``tokenmill serve`` option (``--header-timeout-seconds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from tokenmill.request import ParameterError


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on each connection's time and on the number of connections; each field's ``help`` says what it bounds."""

    header_timeout_seconds: float = field(
        default=10.0,
        metadata={
            "help": "a request's headers must arrive within this of the connection or its first byte; else closed"
        },
    )
    body_timeout_seconds: float = field(
        default=60.0, metadata={"help": "a request's whole body must arrive within this of its headers; else 408"}
    )
    keep_alive_timeout_seconds: float = field(
        default=5.0, metadata={"help": "an idle connection between requests is closed after this"}
    )
    max_connections: int = field(
        default=512, metadata={"help": "a request on a connection beyond this many open ones gets 503"}
    )
    max_header_bytes: int = field(
        default=16 * 1024, metadata={"help": "a request line plus headers larger than this gets 400"}
    )

    def __post_init__(self) -> None:
        for limit in fields(self):
            value = getattr(self, limit.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ParameterError(limit.name, f"must be a positive number, got {value!r}")
            if limit.type == "int" and not isinstance(value, int):
                raise ParameterError(limit.name, f"must be an integer, got {value!r}")
