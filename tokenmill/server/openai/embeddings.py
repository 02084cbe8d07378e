"""OpenAI embeddings: ``POST /v1/embeddings`` (an embedder: runner "pooling").

``input`` is a string, a list of strings, token ids or a list of token-id lists; each input is one
engine pooling request (:class:`~tokenmill.request.PoolingParams`, the model's pooling), scheduled
under the same budget and limits as generation; every input is validated before any is queued
(``AsyncEngine.pool``). ``dimensions`` keeps the first ``d`` values before normalizing (1 .. the
model's hidden size). ``encoding_format`` "float" (default) or "base64": the little-endian float32
bytes, base64-encoded, as OpenAI sends them. ``truncate_prompt_tokens`` (vLLM's) cuts each input to
``k`` tokens (a decoder's last ones, an encoder's text as its tokenizer truncates it). ``usage``
counts each input's tokens once (after truncation). Refusals name the parameter: ``input`` (empty,
too long, bad token ids), ``dimensions``.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.metrics import RequestTracker
from tokenmill.request import PoolingParams, RequestOutput
from tokenmill.server.http.errors import APIError, engine_errors
from tokenmill.server.http.json_body import json_response
from tokenmill.server.http.state import State, check_unicode
from tokenmill.server.openai.output import raise_on_error
from tokenmill.server.openai.protocol import EmbeddingRequest
from tokenmill.server.shared.generation import until_disconnected

router = APIRouter()

ALIASES = {"prompt": "input"}
"""The engine's parameter names -> this route's."""


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, state: State) -> Response:
    arrival = time.monotonic()
    state.check_model(body.model, adapters=False, runner="pooling")
    inputs = _inputs(body.input)
    limit = max(1, state.engine.config.max_waiting_requests)
    if not inputs:
        raise APIError(400, "input is empty", param="input")
    if len(inputs) > limit:  # could never all be queued: refused before tokenizing
        raise APIError(
            400,
            f"input holds {len(inputs)} inputs; one call may hold at most {limit} (the server's max_waiting_requests)",
            param="input",
        )
    check_unicode(inputs, "input")
    rid = f"embd-{uuid.uuid4().hex}"
    params = PoolingParams(dimensions=body.dimensions, truncate_prompt_tokens=body.truncate_prompt_tokens)
    with engine_errors(ALIASES):
        outputs = await until_disconnected(request, state.async_engine.pool(inputs, params, rid))
    for output in outputs:
        tracker = RequestTracker(state.metrics, arrival, len(output.prompt_token_ids), 1)
        tracker.observe(output)
        tracker.close()
    return await json_response(_response(outputs, state.model_name, body.encoding_format or "float"))


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """One prompt per input: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]  # type: ignore[list-item]
    return value  # type: ignore[return-value]


def _response(outputs: list[RequestOutput], model: str, encoding_format: str) -> dict[str, Any]:
    for output in outputs:
        raise_on_error(output)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(output.embedding or [], encoding_format)}
        for i, output in enumerate(outputs)
    ]
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """``embedding`` as floats, or its little-endian float32 bytes in base64."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
