"""The HTTP app: FastAPI app factory, API-key check, operational routes.

Routes: OpenAI (:mod:`tokenmill.server.openai`, ``openai_chat``, ``openai_completions``, ``openai_responses``),
Anthropic (:mod:`tokenmill.server.anthropic`), vLLM's ``/tokenize`` and ``/detokenize``
(:mod:`tokenmill.server.tokenization`),
``GET /health`` (200 while the engine loop runs, else 503; never needs the API key),
``GET /metrics`` (Prometheus text), ``GET /version``, and the RL control routes of
:mod:`tokenmill.server.admin` (weight updates from disk under ``allowed_weight_roots``,
pause/resume, weight version).

With ``api_key`` set, every route but ``/health`` needs ``Authorization: Bearer KEY`` or
``x-api-key: KEY``, checked before the body is read (:class:`~tokenmill.server.auth.APIKeyCheck`).
Request bodies over ``max_body_bytes`` are refused with 413, bodies not complete within
``body_timeout_seconds`` with 408 (:class:`~tokenmill.server.body_limit.BodyLimits`). CORS is off
unless ``allowed_origins`` names origins (``"*"``: any); then browsers on those origins may call
every route (preflights are answered before the API-key check, which then applies as usual).
Starting and stopping a server: :mod:`tokenmill.server.lifecycle`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.engine.engine import Engine
from tokenmill.metrics import ServerMetrics
from tokenmill.server import (
    admin,
    anthropic,
    openai,
    openai_chat,
    openai_completions,
    openai_responses,
    tokenization,
)
from tokenmill.server.auth import APIKeyCheck
from tokenmill.server.body_limit import BodyLimits
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.limits import ConnectionLimits
from tokenmill.server.state import ServerState, State

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(
    engine: Engine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_weight_roots: Iterable[str | Path] = (),
    body_timeout_seconds: float = ConnectionLimits.body_timeout_seconds,
    allow_special_tokens_in_content: bool = False,
    allowed_origins: Sequence[str] = (),
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
) -> FastAPI:
    """An app serving ``engine`` (which the caller owns and shuts down).

    ``served_model_name`` is the name clients must send as ``model``; default: the model folder's name.
    ``allowed_weight_roots``: folders ``POST /update_weights_from_disk`` may load from (none: refused).
    ``allowed_origins``: origins browsers may call from (CORS; none: CORS off), with ``allowed_methods``
    and ``allowed_headers``.
    """
    name = served_model_name or engine.config.model_path().name
    app = FastAPI(title="tokenmill", version=__version__, openapi_url=None if api_key else "/openapi.json")
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, timeout_s=body_timeout_seconds)
    if api_key is not None:  # added last, so it runs first: before anything reads the body
        app.add_middleware(APIKeyCheck, api_key=api_key)
    if allowed_origins:  # after the key check, so it runs before it: preflights carry no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=list(allowed_methods),
            allow_headers=list(allowed_headers),
        )
    app.state.server = ServerState(engine, name, ServerMetrics(engine), allow_special_tokens_in_content)
    install_error_handlers(app, max_body_bytes)
    app.include_router(openai.router)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_responses.router)
    app.include_router(anthropic.router)
    app.include_router(tokenization.router)
    app.include_router(admin.build_router(allowed_weight_roots))

    @app.get("/health")
    async def health(state: State) -> JSONResponse:
        if state.engine.is_healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine is not running"}, status_code=503)

    @app.get("/metrics")
    async def metrics(state: State) -> Response:
        return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app
