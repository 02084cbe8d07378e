"""The HTTP app: FastAPI app factory, API-key check, operational routes.

Routes: OpenAI (:mod:`tokenmill.server.openai`, ``openai_chat``, ``openai_completions``, ``openai_responses``),
Anthropic (:mod:`tokenmill.server.anthropic`), vLLM's ``/tokenize`` and ``/detokenize``
(:mod:`tokenmill.server.tokenization`),
``GET /health`` (200 while the engine loop runs, else 503; never needs the API key),
``GET /metrics`` (Prometheus text), ``GET /version``, and the RL control routes of
:mod:`tokenmill.server.admin` (weight updates from disk under ``allowed_weight_roots``,
pause/resume, weight version).

The options are a :class:`~tokenmill.server.config.ServerConfig`. With ``api_key`` set, every route
but ``/health`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, checked before the body is
read (:class:`~tokenmill.server.auth.APIKeyCheck`). Request bodies over ``max_body_bytes`` are refused
with 413, bodies not complete within ``body_timeout_seconds`` with 408
(:class:`~tokenmill.server.body_limit.BodyLimits`). CORS is off unless ``allowed_origins`` names
origins (``"*"``: any); then browsers on those origins may call every route (preflights are
answered before the API-key check, which then applies as usual).
Starting and stopping a server: :mod:`tokenmill.server.lifecycle`.
"""

from __future__ import annotations

import asyncio

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
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.state import ServerState, State


def create_app(engine: Engine, config: ServerConfig = ServerConfig()) -> FastAPI:
    """An app serving ``engine`` (which the caller owns and shuts down) as ``config`` says.

    Of ``config`` the app reads the model name, the API key, CORS, the body limits, the allowed weight
    roots and ``allow_special_tokens_in_content``; the listening and connection settings are the
    server's (:func:`~tokenmill.server.lifecycle.build_server`).
    """
    name = config.served_model_name or engine.config.model_path().name
    app = FastAPI(title="tokenmill", version=__version__, openapi_url=None if config.api_key else "/openapi.json")
    app.add_middleware(BodyLimits, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_seconds)
    if config.api_key is not None:  # added last, so it runs first: before anything reads the body
        app.add_middleware(APIKeyCheck, api_key=config.api_key)
    if config.allowed_origins:  # after the key check, so it runs before it: preflights carry no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
        )
    app.state.server = ServerState(engine, name, ServerMetrics(engine), config.allow_special_tokens_in_content)
    install_error_handlers(app, config.max_body_bytes)
    app.include_router(openai.router)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_responses.router)
    app.include_router(anthropic.router)
    app.include_router(tokenization.router)
    app.include_router(admin.build_router(config.allowed_weight_roots))

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
