"""Status routes: ``GET /health`` (200 while the engine loop runs, else 503; the one route that never
needs the API key), ``GET /metrics`` (Prometheus text) and ``GET /version``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.server.http.state import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    if state.engine.is_healthy():
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine is not running"}, status_code=503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
