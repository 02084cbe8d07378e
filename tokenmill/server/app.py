"""The HTTP server: FastAPI app factory, API-key check, operational routes, ``run_server``.

Routes: OpenAI (:mod:`tokenmill.server.openai`), Anthropic (:mod:`tokenmill.server.anthropic`),
``GET /health`` (200 while the engine loop runs, else 503; never needs the API key),
``GET /metrics`` (Prometheus text), ``GET /version``, and the RL control routes of
:mod:`tokenmill.server.admin` (weight updates from disk under ``allowed_weight_roots``,
pause/resume, weight version).

With ``api_key`` set, every route but ``/health`` needs ``Authorization: Bearer KEY`` or
``x-api-key: KEY``. Request bodies over ``max_body_bytes`` are refused with 413
(:class:`~tokenmill.server.body_limit.BodySizeLimit`).

``run_server`` shuts down gracefully on SIGTERM or SIGINT: the listening socket is closed, requests
that still arrive get 503, those in flight get ``shutdown_grace_seconds`` to finish, then the
engine aborts the rest (streams end with ``finish_reason: "abort"``), the engine stops, and
``run_server`` returns normally (``tokenmill serve`` exits 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill import __version__
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine, EngineDeadError
from tokenmill.metrics import ServerMetrics
from tokenmill.server import admin, anthropic, openai
from tokenmill.server.body_limit import BodySizeLimit
from tokenmill.server.errors import APIError, error_response, install_error_handlers
from tokenmill.server.state import ServerState, State

logger = logging.getLogger("tokenmill.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 10.0
SHUTDOWN_BACKSTOP_S = 5.0  # after the grace period and the aborts, uvicorn cancels what is left
ABORT_POLL_S = 0.1


def _api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency that lets a request through only if it carries ``api_key`` (constant-time compare)."""
    expected = api_key.encode() if api_key is not None else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        offered = [request.headers.get("x-api-key", ""), token.strip() if scheme.lower() == "bearer" else ""]
        if not any(key and hmac.compare_digest(key.encode(), expected) for key in offered):
            raise APIError(
                401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)", code="invalid_api_key"
            )

    return check


def create_app(
    engine: Engine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_weight_roots: Iterable[str | Path] = (),
) -> FastAPI:
    """An app serving ``engine`` (which the caller owns and shuts down).

    ``served_model_name`` is the name clients must send as ``model``; default: the model folder's name.
    ``allowed_weight_roots``: folders ``POST /update_weights_from_disk`` may load from (none: refused).
    """
    name = served_model_name or engine.config.model_path().name
    app = FastAPI(title="tokenmill", version=__version__, openapi_url=None if api_key else "/openapi.json")
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.state.server = ServerState(engine, name, ServerMetrics(engine))
    install_error_handlers(app, max_body_bytes)
    auth = [Depends(_api_key_check(api_key))]
    app.include_router(openai.router, dependencies=auth)
    app.include_router(anthropic.router, dependencies=auth)
    app.include_router(admin.build_router(allowed_weight_roots), dependencies=auth)

    @app.get("/health")
    async def health(state: State) -> JSONResponse:
        if state.engine.is_healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine is not running"}, status_code=503)

    @app.get("/metrics", dependencies=auth)
    async def metrics(state: State) -> Response:
        return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", dependencies=auth)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app


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
