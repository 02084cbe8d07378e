"""HeaderLimitsH11Protocol: uvicorn's h11 protocol with a deadline and a size cap for each request's headers.

uvicorn has no header timeout: its keep-alive timer starts only after a response, and any byte
received cancels it, so a client that connects and sends nothing, or sends its headers a byte at a
time, holds the connection forever (slowloris). Here a request's line and headers must be complete
within ``header_timeout_s`` of the connection opening, or of the first byte after a response;
otherwise the connection is closed. Once the headers are in, the app's body timeout and the
keep-alive timeout take over.

Size: h11's ``max_incomplete_event_size`` bounds only headers still incomplete, so a header block
larger than it that arrives whole (in one read, or completed by one) would pass. Here the bytes of
a request's line and headers are counted as they arrive, up to their blank line; past
``max_header_bytes`` the request gets a 400 and the connection is closed, as h11 answers it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState


class HeaderLimitsH11Protocol(H11Protocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        header_timeout_s: float,
        max_header_bytes: int,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout_s = header_timeout_s
        self.max_header_bytes = max_header_bytes
        self.header_deadline: asyncio.TimerHandle | None = None
        self.header_bytes = 0  # of the request whose headers are arriving

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers():
            if self.header_deadline is None:
                self._arm_header_deadline()  # the first byte of the next request on a kept-alive connection
            end = data.find(b"\r\n\r\n")  # a blank line split across reads is counted whole: 3 bytes over at most
            self.header_bytes += len(data) if end < 0 else end + 4
            if self.header_bytes > self.max_header_bytes:
                self._refuse_oversized_headers()
                return
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._cancel_header_deadline()  # idle until the next request: the keep-alive timer's business
        self.header_bytes = 0
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

    def _refuse_oversized_headers(self) -> None:
        self._cancel_header_deadline()
        if self.conn.our_state is h11.IDLE and not self.transport.is_closing():
            self.send_400_response(f"Request line and headers exceed {self.max_header_bytes} bytes")
        else:
            self.transport.close()

    def _header_deadline_passed(self) -> None:
        self.header_deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.logger.debug("closing a connection whose request headers did not arrive in time")
            if self.conn.our_state in (h11.IDLE, h11.DONE):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
