"""RL control routes: weight updates from disk, pausing generation, the weight version.

- ``POST /update_weights_from_disk`` ``{"model_path", "version", "flush_cache", "abort_running"}``
  loads a safetensors checkpoint folder into the running engine (validated first, all or
  nothing: see :meth:`~tokenmill.engine.engine.Engine.update_weights`) and answers
  ``{"success": true, "weight_version": N}``. ``model_path`` and every weight file it names must
  resolve (``..`` and symlinks followed) to a path under one of the server's allowed weight roots;
  with no roots configured every path is refused. Outside the roots -> 403; a missing folder, a
  non-safetensors or invalid checkpoint (non-finite values included), or a ``version`` that is not
  an integer in ``[0, 2**63)`` above the current one -> 400, engine unchanged.
- ``POST /pause_generation`` / ``POST /resume_generation`` -> ``{"success": true, "paused": bool}``:
  requests stay queued or running, no step runs while paused.
- ``GET /weight_version`` -> ``{"weight_version": N}``.

The app protects these routes with the API key like every other route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import Field, StrictInt
from safetensors import SafetensorError

from tokenmill.engine.engine import Engine, EngineDeadError
from tokenmill.model.loader import weight_files
from tokenmill.request import ParameterError
from tokenmill.server.http.errors import APIError
from tokenmill.server.http.state import State
from tokenmill.server.shared.request_body import Body
from tokenmill.worker.weight_update import MAX_WEIGHT_VERSION


class UpdateWeightsRequest(Body):
    model_path: str = Field(min_length=1)
    version: Annotated[StrictInt, Field(ge=0, le=MAX_WEIGHT_VERSION)] | None = None
    flush_cache: bool = True
    abort_running: bool = False


class WeightRoots:
    """The folders weights may be loaded from, resolved once; membership follows symlinks and ``..``."""

    def __init__(self, roots: Iterable[str | Path]) -> None:
        self.roots = [Path(root).resolve() for root in roots]

    def check(self, path: str | Path) -> Path:
        """``path`` resolved; APIError 403 unless it lies under a root (400 if it cannot be resolved)."""
        try:
            resolved = Path(path).resolve()
        except (OSError, ValueError, RuntimeError) as exc:  # NUL bytes, symlink loops, over-long names
            raise APIError(
                400, f"model_path {str(path)!r} cannot be resolved: {exc}", param="model_path", code="invalid_weights"
            ) from exc
        if not self.roots:
            raise APIError(
                403,
                "loading weights from disk is disabled: the server has no allowed weight roots "
                "(start it with --allowed-weight-roots DIR)",
                param="model_path",
                code="weight_path_forbidden",
            )
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise APIError(
                403,
                f"model_path {str(path)!r} is outside the allowed weight roots",
                param="model_path",
                code="weight_path_forbidden",
            )
        return resolved


async def engine_call(fn: Callable[[], Any]) -> Any:
    """Run a blocking engine call in a worker thread; a dead engine -> 503."""
    try:
        return await asyncio.to_thread(fn)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from exc


def build_router(allowed_weight_roots: Iterable[str | Path] = ()) -> APIRouter:
    """The admin routes; ``update_weights_from_disk`` loads only from under ``allowed_weight_roots``."""
    roots = WeightRoots(allowed_weight_roots)
    router = APIRouter()

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest, state: State) -> dict[str, Any]:
        folder = roots.check(body.model_path)
        engine: Engine = state.engine

        def update() -> int:
            for file in weight_files(folder):  # shards named by an index must stay inside the roots too
                roots.check(file)
            return engine.update_weights(
                folder, version=body.version, flush_cache=body.flush_cache, abort_running=body.abort_running
            )

        try:
            version = await engine_call(update)
        except (ValueError, OSError, SafetensorError) as exc:  # WeightError is a ValueError
            param = exc.param if isinstance(exc, ParameterError) else "model_path"
            raise APIError(
                400, f"cannot update weights from {body.model_path!r}: {exc}", param=param, code="invalid_weights"
            ) from exc
        return {"success": True, "weight_version": version}

    @router.post("/pause_generation")
    async def pause_generation(state: State) -> dict[str, Any]:
        await engine_call(state.engine.pause_generation)
        return {"success": True, "paused": state.engine.paused}

    @router.post("/resume_generation")
    async def resume_generation(state: State) -> dict[str, Any]:
        await engine_call(state.engine.resume_generation)
        return {"success": True, "paused": state.engine.paused}

    @router.get("/weight_version")
    async def weight_version(state: State) -> dict[str, int]:
        return {"weight_version": state.engine.weight_version}

    return router
