"""Starting and stopping a server: ``run_server``, and the drain that makes shutdown graceful.

``run_server`` shuts down gracefully on SIGTERM or SIGINT: the listening socket is closed, requests
that still arrive get 503, those in flight get ``shutdown_grace_seconds`` to finish, then the
engine aborts the rest (streams end with ``finish_reason: "abort"``), the engine stops, and
``run_server`` returns normally (``tokenmill serve`` exits 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import uvicorn
from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine, EngineDeadError
from tokenmill.server.app import DEFAULT_MAX_BODY_BYTES, create_app
from tokenmill.server.errors import APIError, error_response

logger = logging.getLogger("tokenmill.server")

DEFAULT_SHUTDOWN_GRACE_S = 10.0
SHUTDOWN_BACKSTOP_S = 5.0  # after the grace period and the aborts, uvicorn cancels what is left
ABORT_POLL_S = 0.1


class DrainGate:
    """ASGI wrapper that counts HTTP requests in flight and, once ``closed``, answers new ones 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.closed = False
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.closed:
            error = APIError(503, "the server is shutting down", code="shutting_down")
            response = error_response(Request(scope), error)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        self.in_flight += 1
        self.idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains before it stops.

    On exit it closes ``gate`` (new requests: 503) while uvicorn stops listening, waits up to
    ``grace_s`` for the requests in flight, then aborts whatever the engine still runs (again
    every ``ABORT_POLL_S``, for requests admitted just before the gate closed) until every
    connection has finished. Configure uvicorn's ``timeout_graceful_shutdown`` above ``grace_s``:
    it is only the backstop.
    """

    def __init__(self, config: uvicorn.Config, gate: DrainGate, engine: Engine, grace_s: float) -> None:
        super().__init__(config)
        self.gate = gate
        self.engine = engine
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.gate.closed = True
        drain = asyncio.create_task(self._abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    async def _abort_after_grace(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.gate.idle.wait(), self.grace_s)
        with contextlib.suppress(EngineDeadError):
            while True:
                aborted = await asyncio.to_thread(self.engine.abort_all)
                if aborted:
                    logger.warning("shutdown: aborted %d request(s) still running after the grace period", aborted)
                await asyncio.sleep(ABORT_POLL_S)


@contextlib.contextmanager
def _exit_signals_consumed() -> Iterator[None]:
    """Let SIGINT/SIGTERM end only the server, not the process.

    uvicorn handles these signals while it serves and re-raises them once it has shut down; the
    handlers installed here (in the main thread only) consume the re-raised signal, so the
    caller returns normally.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    exit_signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in exit_signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_weight_roots: Iterable[str | Path] = (),
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_S,
) -> None:
    """Start an engine and serve it until SIGINT/SIGTERM, then shut down gracefully and return.

    Graceful shutdown: see the module docstring; requests still running ``shutdown_grace_seconds``
    after the signal are aborted.
    """
    if not shutdown_grace_seconds >= 0:
        raise ValueError(f"shutdown_grace_seconds must be >= 0, got {shutdown_grace_seconds}")
    engine = Engine(config)
    try:
        gate = DrainGate(create_app(engine, served_model_name, api_key, max_body_bytes, allowed_weight_roots))
        uvicorn_config = uvicorn.Config(
            gate, host=host, port=port, timeout_graceful_shutdown=int(shutdown_grace_seconds + SHUTDOWN_BACKSTOP_S)
        )
        with _exit_signals_consumed():
            GracefulServer(uvicorn_config, gate, engine, shutdown_grace_seconds).run()
    finally:
        engine.shutdown()
