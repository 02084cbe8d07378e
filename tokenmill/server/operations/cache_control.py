"""Cache control: ``POST /reset_prefix_cache`` forgets every cached prefix, on the device and on the
host and disk tiers (vLLM's route; running requests keep their KV). Protected by the API key like every route."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from tokenmill.server.http.errors import engine_errors
from tokenmill.server.http.state import State

router = APIRouter()


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: State) -> dict[str, Any]:
    with engine_errors({}):  # a dead engine: 503
        await asyncio.to_thread(state.engine.reset_prefix_cache)
    return {"success": True}
