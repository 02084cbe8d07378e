"""ServerConfig: every option of the HTTP server, in one frozen dataclass.

Pure settings (no server imports), so the command line derives its ``tokenmill serve`` flags from
them before the server stack loads: each field is an :func:`~tokenmill.config.option`, its help text
and section in the field's metadata, its default written here only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from tokenmill.config import option
from tokenmill.request import ParameterError

_POSITIVE_LIMITS = (
    "header_timeout_seconds",
    "body_timeout_seconds",
    "keep_alive_timeout_seconds",
    "max_requests_in_progress",
    "max_header_bytes",
    "max_arriving_body_bytes",
)


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens, whom it lets in, and how much time and data each connection may take.

    Sequences given as lists are stored as tuples. Raises ParameterError naming the field for a
    connection limit that is not a positive finite number (an integer where the field is an int) and
    for a negative ``shutdown_grace_seconds``.
    """

    host: str = option("127.0.0.1", "address to listen on", section="server", metavar="HOST")
    port: int = option(8000, "port to listen on", section="server", metavar="PORT")
    served_model_name: str | None = option(
        None, "model name clients send; None: the model folder's name", section="server", metavar="NAME"
    )
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' (or x-api-key: KEY) on every route but /health; None: no key",
        section="server",
        metavar="KEY",
    )
    shutdown_grace_seconds: float = option(
        10.0,
        "on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted",
        section="server",
        metavar="S",
    )
    web_ui: bool = option(
        True, "serve the chat page at / (with a status tab); --no-web-ui leaves it out", section="server"
    )
    allow_special_tokens_in_content: bool = option(
        False,
        "tokenize special-token text typed in chat messages and tool definitions as control tokens, not as text",
        section="server",
    )

    allowed_hosts: tuple[str, ...] = option(
        (),
        "Host header names the server answers to (DNS rebinding: another site's name pointed at this "
        "address); repeatable or comma-separated; none: the loopback names for a server without an API key "
        "listening on a loopback address, else any",
        section="server",
        metavar="LIST",
        comma_separated=True,
    )
    allowed_origins: tuple[str, ...] = option(
        (),
        "origins browsers may call the server from, '*' for any; repeatable or comma-separated; none: CORS off",
        section="CORS",
        metavar="LIST",
        comma_separated=True,
    )
    allowed_methods: tuple[str, ...] = option(
        ("*",),
        "HTTP methods allowed from those origins; repeatable or comma-separated",
        section="CORS",
        metavar="LIST",
        comma_separated=True,
    )
    allowed_headers: tuple[str, ...] = option(
        ("*",),
        "request headers allowed from those origins; repeatable or comma-separated",
        section="CORS",
        metavar="LIST",
        comma_separated=True,
    )

    header_timeout_seconds: float = option(
        10.0,
        "a request's headers must arrive within this of the connection or its first byte; else closed",
        section="connection limits",
    )
    body_timeout_seconds: float = option(
        60.0, "a request's whole body must arrive within this of its headers; else 408", section="connection limits"
    )
    keep_alive_timeout_seconds: float = option(
        5.0, "an idle connection between requests is closed after this", section="connection limits"
    )
    max_requests_in_progress: int = option(
        512,
        "a request beyond this many in progress gets 503 (idle connections do not count; /health is always answered)",
        section="connection limits",
    )
    max_header_bytes: int = option(
        16 * 1024, "a request line plus headers larger than this gets 400", section="connection limits"
    )
    max_body_bytes: int = option(
        4 * 1024 * 1024, "a request body larger than this gets 413", section="connection limits"
    )
    max_arriving_body_bytes: int = option(
        64 * 1024 * 1024,
        "request bodies still arriving hold at most this many bytes in all; one that would pass it gets 503",
        section="connection limits",
    )

    allowed_weight_roots: tuple[str, ...] = option(
        (),
        "folders POST /update_weights_from_disk may load checkpoints from, and POST /v1/load_lora_adapter "
        "LoRA adapters; none: loading is refused",
        section="weight updates",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            if setting.type.startswith("tuple[") and not isinstance(value, tuple):
                if isinstance(value, str):
                    raise ParameterError(setting.name, f"must be a sequence of strings, got {value!r}")
                object.__setattr__(self, setting.name, tuple(str(item) for item in value))
        for setting in fields(self):
            if setting.name not in _POSITIVE_LIMITS:
                continue
            value = getattr(self, setting.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ParameterError(setting.name, f"must be a positive number, got {value!r}")
            if setting.type == "int" and not isinstance(value, int):
                raise ParameterError(setting.name, f"must be an integer, got {value!r}")
        if not self.shutdown_grace_seconds >= 0:
            raise ParameterError("shutdown_grace_seconds", f"must be >= 0, got {self.shutdown_grace_seconds}")
        if self.max_arriving_body_bytes < self.max_body_bytes:  # else one allowed body could never arrive
            raise ParameterError(
                "max_arriving_body_bytes",
                f"must be >= max_body_bytes ({self.max_body_bytes}), got {self.max_arriving_body_bytes}",
            )
