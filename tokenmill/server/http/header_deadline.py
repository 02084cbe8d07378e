"""HeaderDeadlineH11Protocol: uvicorn's h11 protocol with a deadline for each request's headers.

uvicorn has no header timeout: its keep-alive timer starts only after a response, and any byte
received cancels it, so a client that connects and sends nothing, or sends its headers a byte at a
time, holds the connection forever (slowloris). Here a request's line and headers must be complete
within ``header_timeout_s`` of the connection opening, or of the first byte after a response;
otherwise the connection is closed. Once the headers are in, the app's body timeout and the
keep-alive timeout take over.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState


class HeaderDeadlineH11Protocol(H11Protocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        header_timeout_s: float,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout_s = header_timeout_s
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.header_deadline is None and self._awaiting_headers():
            self._arm_header_deadline()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._cancel_header_deadline()  # idle until the next request: the keep-alive timer's business
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        """True while no request is in progress on this connection (its headers are not complete)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self.header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _header_deadline_passed(self) -> None:
        self.header_deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.logger.debug("closing a connection whose request headers did not arrive in time")
            if self.conn.our_state in (h11.IDLE, h11.DONE):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
