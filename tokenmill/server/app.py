"""The HTTP app: middleware in front of every route, the error shapes, and the routers of each API.

Routes: OpenAI's and vLLM's (:mod:`tokenmill.server.openai`: models, chat completions, completions,
responses, embeddings, score and rerank, tokenization), Anthropic's
(:mod:`tokenmill.server.anthropic`: messages), and the operations routes
(:mod:`tokenmill.server.operations`: health, metrics, status, version, RL control), and the chat
page (:mod:`tokenmill.server.web`, unless ``web_ui`` is off).

The options are a :class:`~tokenmill.server.config.ServerConfig`. With ``api_key`` set, every route
but ``/health`` and the page's static files needs ``Authorization: Bearer KEY`` or ``x-api-key:
KEY``, checked before the body is read (:class:`~tokenmill.server.http.auth.APIKeyCheck`). Request
bodies over ``max_body_bytes`` are refused with 413, bodies not complete within ``body_timeout_seconds`` with 408
(:class:`~tokenmill.server.http.body_limit.BodyLimits`). CORS is off unless ``allowed_origins`` names
origins (``"*"``: any); then browsers on those origins may call every route (preflights are
answered before the API-key check, which then applies as usual). Another site's page cannot drive
the server through the user's browser (:class:`~tokenmill.server.http.cross_site.CrossSiteGuard`:
the Host name, a keyless server's request origins, form content types).
Starting and stopping a server: :mod:`tokenmill.server.lifecycle`.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenmill import __version__
from tokenmill.engine.engine import Engine
from tokenmill.metrics import ServerMetrics
from tokenmill.server.anthropic import messages
from tokenmill.server.config import ServerConfig
from tokenmill.server.http.auth import APIKeyCheck
from tokenmill.server.http.body_limit import BodyLimits
from tokenmill.server.http.cross_site import CrossSiteGuard, default_allowed_hosts
from tokenmill.server.http.errors import install_error_handlers
from tokenmill.server.http.state import ServerState
from tokenmill.server.openai import chat, completions, embeddings, models, responses, scoring, tokenization
from tokenmill.server.operations import cache_control, lora_control, rl_control, status
from tokenmill.server.web import page


def create_app(engine: Engine, config: ServerConfig = ServerConfig()) -> FastAPI:
    """An app serving ``engine`` (which the caller owns and shuts down) as ``config`` says.

    Of ``config`` the app reads the model name, the API key, CORS, the body limits, the allowed weight
    roots and ``allow_special_tokens_in_content``; the listening and connection settings are the
    server's (:func:`~tokenmill.server.lifecycle.build_server`).
    """
    name = config.served_model_name or engine.config.model_name()
    app = FastAPI(title="tokenmill", version=__version__, openapi_url=None if config.api_key else "/openapi.json")
    app.add_middleware(
        BodyLimits,
        max_bytes=config.max_body_bytes,
        timeout_s=config.body_timeout_seconds,
        max_arriving_bytes=config.max_arriving_body_bytes,
    )
    if config.api_key is not None:  # added last, so it runs first: before anything reads the body
        app.add_middleware(APIKeyCheck, api_key=config.api_key)
    allowed_hosts = default_allowed_hosts(config.host, config.allowed_hosts, keyless=config.api_key is None)
    app.add_middleware(  # runs before the key check (after CORS, which only answers preflights itself)
        CrossSiteGuard,
        allowed_hosts=allowed_hosts,
        allowed_origins=config.allowed_origins,
        check_origin=config.api_key is None,
    )
    if config.allowed_origins:  # after the key check, so it runs before it: preflights carry no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
        )
    app.state.server = ServerState(engine, name, ServerMetrics(engine), config.allow_special_tokens_in_content)
    install_error_handlers(app, config.max_body_bytes)
    routers = (models, chat, completions, responses, embeddings, scoring, tokenization, messages, status, cache_control)
    for module in routers:
        app.include_router(module.router)
    app.include_router(rl_control.build_router(config.allowed_weight_roots))
    app.include_router(lora_control.build_router(config.allowed_weight_roots))
    if config.web_ui:
        app.include_router(page.router)
        app.mount("/web", page.static_files(), name="web")
    return app
