"""Status routes: ``GET /health`` (200 while the engine loop runs, else 503; the one route that never
needs the API key), ``GET /metrics`` (Prometheus text), ``GET /status`` (what the server runs and
how busy it is, as JSON: the web page's status tab) and ``GET /version``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.server.http.errors import engine_errors
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


@router.get("/status")
async def status(state: State) -> dict[str, Any]:
    """The model and its settings, requests running and waiting, KV pages (used by requests, cached
    only, free), the prefix cache's hit rate, the KV dtype, the host and disk tiers' hit rates and sizes
    (None without them) and the output tokens served so far."""
    engine = state.engine
    with engine_errors({}):  # a dead engine: 503
        stats = await asyncio.to_thread(engine.stats)
    cache = stats["cache"]
    free, cached = stats["kv_free_pages"], stats["kv_cached_pages"]
    queried = cache["prefix_query_tokens"]
    return {
        "model": state.model_name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.config.quantization or engine.model.checkpoint_quantization,
        "attention_backend": "none (encoder)" if engine.model.backend is None else engine.model.backend.name,
        "runner": engine.runner,
        "running": stats["running"],
        "waiting": stats["waiting"],
        "kv_pages_used": stats["kv_capacity_pages"] - free - cached,
        "kv_pages_cached": cached,
        "kv_pages_free": free,
        "prefix_cache_hit_rate": cache["prefix_hit_tokens"] / queried if queried else 0.0,
        "kv_cache_dtype": str(engine.worker.storage.k_buffer.dtype).removeprefix("torch."),
        "host_tier": _tier(stats["host_tier"]),
        "disk_tier": _tier(stats["disk_tier"]),
        "generation_tokens": int(state.metrics.registry.get_sample_value("tokenmill_generation_tokens_total") or 0),
    }


def _tier(tier: dict[str, Any] | None) -> dict[str, Any] | None:
    """A host or disk tier's hit rate (prompt tokens it served / looked up), blocks and bytes; None without one."""
    if tier is None:
        return None
    queried = tier["query_tokens"]
    hit_rate = tier["hit_tokens"] / queried if queried else 0.0
    return {"hit_rate": hit_rate, "blocks": tier["blocks"], "bytes": tier["bytes"], "max_bytes": tier["max_bytes"]}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
