"""Anthropic-compatible route: ``POST /v1/messages``.

The system prompt and messages go through the model's chat template. Content blocks: text;
``tool_use`` and ``tool_result`` blocks are rendered as text (the model sees them, the template
gets plain strings); ``tools`` are refused. ``stop_reason``: end_turn (EOS), max_tokens,
stop_sequence (with ``stop_sequence`` set); a request the server aborts (shutdown, an admin abort)
ends in an error instead (503 ``overloaded_error``, or an ``error`` event mid-stream), never a stop
reason. Streaming sends Anthropic's event sequence:
message_start, content_block_start, ping, content_block_delta*, content_block_stop,
message_delta (stop_reason, usage), message_stop. Errors use Anthropic's error shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.request import CompletionOutput, FinishReason
from tokenmill.server.errors import APIError, engine_errors
from tokenmill.server.generation import Generation, until_disconnected
from tokenmill.server.params import sampling_params
from tokenmill.server.protocol import AnthropicBlock, MessagesRequest
from tokenmill.server.sse import SSEResponse, sse_event
from tokenmill.server.state import State

router = APIRouter()

# engine parameter name -> this route's name for it (error ``param``)
ALIASES = {"prompt": "messages", "stop": "stop_sequences"}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, state: State) -> Response:
    arrival = time.monotonic()
    state.check_model(body.model)
    if body.tools:
        raise APIError(400, "tools are not supported on /v1/messages; use /v1/chat/completions", param="tools")
    chat = [{"role": "system", "content": _text(body.system)}] if body.system else []
    chat += [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    prompt = await state.render_chat(chat, None)
    fields = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    with engine_errors(ALIASES):
        params = sampling_params(fields, body.max_tokens)
        generation = await until_disconnected(request, Generation.start(state, [prompt], [params], rid, arrival))
    if body.stream:
        return SSEResponse(_events(generation, rid, state.model_name), on_close=generation.close)
    try:
        (output,) = await until_disconnected(request, generation.collect())
    finally:
        generation.close()
    out = output.outputs[0]
    if out.error:
        raise APIError(500, f"generation failed (request {rid}): {out.error}")
    if out.finish_reason == FinishReason.ABORT.value:
        raise APIError(503, _aborted(rid))
    message = _message(rid, state.model_name, len(output.prompt_token_ids))
    message["content"] = [{"type": "text", "text": out.text}]
    message.update(_stop(out))
    message["usage"]["output_tokens"] = len(out.token_ids)
    return JSONResponse(message)


def _text(content: str | list[AnthropicBlock]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_block_text(block) for block in content)


def _block_text(block: AnthropicBlock) -> str:
    if block.type == "text" and block.text is not None:
        return block.text
    if block.type == "tool_use":
        return f"[tool call {block.name}] {json.dumps(block.input, ensure_ascii=False)}"
    if block.type == "tool_result":
        return f"[tool result] {_text(block.content or '')}"
    raise APIError(400, f"content blocks of type {block.type!r} are not supported", param="messages")


def _message(rid: str, model: str, input_tokens: int) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


def _aborted(rid: str) -> str:
    return f"request {rid} was aborted by the server before it finished (shutdown or an admin abort); retry"


def _stop(out: CompletionOutput) -> dict[str, Any]:
    if out.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(out.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _event(data: dict[str, Any]) -> str:
    return sse_event(data, event=data["type"])


async def _events(generation: Generation, rid: str, model: str) -> AsyncIterator[str]:
    started = False
    output_tokens = 0
    async for _, delta in generation:
        if not started:
            started = True
            yield _event({"type": "message_start", "message": _message(rid, model, len(delta.prompt_token_ids))})
            yield _event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
            yield _event({"type": "ping"})
        for out in delta.outputs:
            if out.error:
                error = {"type": "api_error", "message": f"generation failed (request {rid}): {out.error}"}
                yield _event({"type": "error", "error": error})
                return
            if out.finish_reason == FinishReason.ABORT.value:
                yield _event({"type": "error", "error": {"type": "overloaded_error", "message": _aborted(rid)}})
                return
            output_tokens += len(out.token_ids)
            if out.text:
                yield _event(
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": out.text}}
                )
            if out.finish_reason is not None:
                yield _event({"type": "content_block_stop", "index": 0})
                yield _event({"type": "message_delta", "delta": _stop(out), "usage": {"output_tokens": output_tokens}})
                yield _event({"type": "message_stop"})
