"""The HTTP app: FastAPI app factory, API-key check, operational routes.

Routes: OpenAI (:mod:`tokenmill.server.openai`, ``openai_chat``, ``openai_completions``),
Anthropic (:mod:`tokenmill.server.anthropic`),
``GET /health`` (200 while the engine loop runs, else 503; never needs the API key),
``GET /metrics`` (Prometheus text), ``GET /version``, and the RL control routes of
:mod:`tokenmill.server.admin` (weight updates from disk under ``allowed_weight_roots``,
pause/resume, weight version).

With ``api_key`` set, every route but ``/health`` needs ``Authorization: Bearer KEY`` or
``x-api-key: KEY``. Request bodies over ``max_body_bytes`` are refused with 413
(:class:`~tokenmill.server.body_limit.BodySizeLimit`). Starting and stopping a server:
:mod:`tokenmill.server.lifecycle`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.engine.engine import Engine
from tokenmill.metrics import ServerMetrics
from tokenmill.server import admin, anthropic, openai, openai_chat, openai_completions
from tokenmill.server.body_limit import BodySizeLimit
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.state import ServerState, State

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


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
    app.include_router(openai_chat.router, dependencies=auth)
    app.include_router(openai_completions.router, dependencies=auth)
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
