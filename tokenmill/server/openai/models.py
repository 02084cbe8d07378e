"""OpenAI's ``GET /v1/models``: the model this server serves, then its loaded LoRA adapters (each
with ``parent``: the base model's id, as vLLM lists them)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tokenmill.server.http.state import State

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    model = {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "tokenmill",
        "max_model_len": state.engine.max_context_len,
        # None, "int8" or "int4" (quantized at load), or a pre-quantized checkpoint's method ("awq", ...)
        "quantization": state.engine.config.quantization or state.engine.model.checkpoint_quantization,
    }
    adapters = [
        {
            "id": name,
            "object": "model",
            "created": state.started,
            "owned_by": "tokenmill",
            "max_model_len": state.engine.max_context_len,
            "parent": state.model_name,
            "root": adapter.source,
        }
        for name, adapter in state.engine.lora_adapters().items()
    ]
    return {"object": "list", "data": [model, *adapters]}
