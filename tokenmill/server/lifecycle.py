"""Starting and stopping a server: ``run_server``, and the drain that makes shutdown graceful.

``run_server`` shuts down gracefully on SIGTERM or SIGINT: the listening socket is closed, requests
that still arrive get 503, those in flight get the config's ``shutdown_grace_seconds`` to finish,
then the engine aborts the rest (streams end with ``finish_reason: "abort"``) and a request whose
body is still arriving is answered 503, the engine stops, and ``run_server`` returns normally
(``tokenmill serve`` exits 0).

Every connection's time is bounded (the connection limits of
:class:`~tokenmill.server.config.ServerConfig`): headers
(:mod:`~tokenmill.server.http.header_limits`), body
(:class:`~tokenmill.server.http.body_limit.BodyLimits`), keep-alive idle time and the number of
connections (uvicorn's own settings); messages that a client or a lack of file descriptors can
repeat at will are throttled in the log (:mod:`~tokenmill.server.http.log_throttle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.engine.engine import Engine, EngineDeadError
from tokenmill.engine.grammar_compile_worker import WORKERS
from tokenmill.server.app import create_app
from tokenmill.server.config import ServerConfig
from tokenmill.server.http.errors import OVERLOADED_RETRY_AFTER_S, APIError, error_response
from tokenmill.server.http.header_limits import HeaderLimitsH11Protocol
from tokenmill.server.http.log_throttle import install_log_throttle

logger = logging.getLogger("tokenmill.server")

SHUTDOWN_BACKSTOP_S = 5.0  # after the grace period and the aborts, uvicorn cancels what is left
ABORT_POLL_S = 0.1


UNLIMITED_PATHS = frozenset({"/health"})
"""Paths answered however many requests are in progress (load balancers' and operators' probes)."""


class DrainGate:
    """ASGI wrapper that counts HTTP requests in flight; answers 503 (in the API's error shape, with
    ``Retry-After``) to a request beyond ``max_in_flight`` of them, except ``/health``, and once
    ``closed`` to every new one. Idle connections are not requests: they never count.

    A request whose body is still arriving counts as in flight. Once ``body_reads_cut`` is set
    (at the end of the grace period), reading the rest of such a body raises ``HTTPException(503)``
    at once, so a half-sent body cannot hold a shutdown.
    """

    def __init__(self, app: ASGIApp, max_in_flight: int) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.closed = False
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self.body_reads_cut = asyncio.Event()

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
        if self.in_flight >= self.max_in_flight and scope.get("path") not in UNLIMITED_PATHS:
            error = APIError(
                503,
                f"the server has {self.in_flight} requests in progress, its limit; retry later",
                code="server_overloaded",
                headers={"retry-after": str(OVERLOADED_RETRY_AFTER_S)},
            )
            await error_response(Request(scope), error)(scope, receive, send)
            return
        self.in_flight += 1
        self.idle.clear()
        try:
            await self.app(scope, self._receive_until_cut(receive), send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    def _receive_until_cut(self, receive: Receive) -> Receive:
        """``receive``, except that a body still arriving when ``body_reads_cut`` is set is refused."""
        body_complete = False

        async def receive_until_cut() -> Message:
            nonlocal body_complete
            if body_complete:
                return await receive()
            receiving = asyncio.ensure_future(receive())
            cut = asyncio.ensure_future(self.body_reads_cut.wait())
            try:
                await asyncio.wait((receiving, cut), return_when=asyncio.FIRST_COMPLETED)
            finally:
                cut.cancel()
                received = receiving.done()
                if not received:
                    receiving.cancel()
            if not received:
                raise HTTPException(503, "the server is shutting down and the request body is not complete")
            message = receiving.result()
            body_complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return receive_until_cut


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains before it stops.

    On exit it closes ``gate`` (new requests: 503) while uvicorn stops listening, waits up to
    ``grace_s`` for the requests in flight, then cuts the bodies still arriving (503) and aborts
    whatever the engine still runs (again
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
        self.gate.body_reads_cut.set()
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


def build_server(engine: Engine, config: ServerConfig = ServerConfig(), log_level: str | None = None) -> GracefulServer:
    """The server for ``engine`` as ``config`` says, with every connection limit and the graceful drain;
    ``.run()`` serves. ``log_level``: uvicorn's (None: its default configuration)."""
    gate = DrainGate(create_app(engine, config), config.max_requests_in_progress)
    uvicorn_config = uvicorn.Config(
        gate,
        host=config.host,
        port=config.port,
        http=functools.partial(
            HeaderLimitsH11Protocol,
            header_timeout_s=config.header_timeout_seconds,
            max_header_bytes=config.max_header_bytes,
        ),
        ws="none",
        timeout_keep_alive=config.keep_alive_timeout_seconds,  # type: ignore[arg-type]  # a float works
        limit_concurrency=None,  # uvicorn's cap counts idle connections too: the gate counts requests
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_graceful_shutdown=int(config.shutdown_grace_seconds + SHUTDOWN_BACKSTOP_S),
        log_level=log_level,
    )
    install_log_throttle()
    return GracefulServer(uvicorn_config, gate, engine, config.shutdown_grace_seconds)


def run_server(engine: Engine, config: ServerConfig = ServerConfig()) -> None:
    """Serve ``engine`` as ``config`` says until SIGINT/SIGTERM, then shut down gracefully (see the
    module docstring; the engine is shut down too) and return."""
    try:
        server = build_server(engine, config)
        # start-up's millions of objects (torch, transformers, the app) live to the end: kept out of
        # every full garbage collection, whose pauses (~250 ms) otherwise stall each connection
        gc.freeze()
        if engine.tokenizer is not None:
            WORKERS.prestart()  # its start-up (seconds: xgrammar's imports) is then off the first structured request
        if config.web_ui:
            logger.info("chat page: http://%s:%d/", config.host, config.port)
        with _exit_signals_consumed():
            server.run()
    finally:
        engine.shutdown()
