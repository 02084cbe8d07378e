"""LoRA adapter routes, vLLM's: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}``, answered with vLLM's plain-text success line.

``lora_path`` must resolve under one of the server's allowed weight roots (as weight updates from
disk: none configured -> every path refused, 403). An adapter that does not fit the model, a name
in use, or an engine without ``--enable-lora`` -> 400; unloading an unknown name -> 404
``model_not_found``, one that unfinished requests use -> 409. Loaded adapters are served under
their names (the ``model`` field) and listed by ``GET /v1/models``. Protected by the API key.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from tokenmill.server.http.errors import APIError
from tokenmill.server.http.state import State
from tokenmill.server.operations.rl_control import WeightRoots, engine_call
from tokenmill.server.shared.request_body import Body


class LoadLoRARequest(Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(Body):
    lora_name: str = Field(min_length=1)


def build_router(allowed_weight_roots: Iterable[str | Path] = ()) -> APIRouter:
    """The adapter routes; adapters load only from under ``allowed_weight_roots``."""
    roots = WeightRoots(allowed_weight_roots)
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest, state: State) -> PlainTextResponse:
        folder = roots.check(body.lora_path)
        if body.lora_name == state.model_name:
            raise APIError(400, f"lora_name {body.lora_name!r} is the served model's name", param="lora_name")
        try:
            await engine_call(lambda: state.engine.load_lora(body.lora_name, str(folder)))
        except ValueError as exc:  # LoRAError, a name in use, LoRA not enabled
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest, state: State) -> PlainTextResponse:
        if body.lora_name not in state.engine.lora_adapters():
            raise APIError(
                404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name", code="model_not_found"
            )
        try:
            await engine_call(lambda: state.engine.unload_lora(body.lora_name))
        except KeyError as exc:  # unloaded meanwhile
            raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name") from exc
        except ValueError as exc:  # in use
            raise APIError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
