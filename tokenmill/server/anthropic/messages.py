"""Anthropic-compatible routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The system prompt, messages and ``tools`` go through the model's chat template; tool calls in the
output are returned as ``tool_use`` blocks, and ``tool_choice`` ``any`` or ``tool`` forces one
(:mod:`tokenmill.server.anthropic.content`). ``stop_reason``: end_turn (EOS), max_tokens,
stop_sequence (with ``stop_sequence`` set), tool_use; a request the server aborts (shutdown, an
admin abort) ends in an error instead (503 ``overloaded_error``, or an ``error`` event mid-stream),
never a stop reason. Streaming sends Anthropic's event sequence: message_start, ping, the content
blocks (each content_block_start, content_block_delta*, content_block_stop; without tools the text
block starts before the ping), message_delta (stop_reason, usage), message_stop. Errors use Anthropic's error shape.

``usage`` follows Anthropic's split of the prompt: ``cache_read_input_tokens`` were served from the
prefix cache, ``input_tokens`` are the rest, and their sum is what ``count_tokens`` reports for the
same body. ``cache_creation_input_tokens`` is always 0: the prefix cache fills itself with every
prompt, at no cost and without ``cache_control`` breakpoints, so no tokens are billed as cache writes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.request import CompletionOutput, FinishReason, RequestOutput
from tokenmill.server.anthropic.content import ContentBlockStream, ToolUse, content_blocks, template_messages, tool_use
from tokenmill.server.anthropic.protocol import MessagesPromptRequest, MessagesRequest
from tokenmill.server.http.errors import APIError, engine_errors
from tokenmill.server.http.json_body import json_response
from tokenmill.server.http.sse import SSEResponse, sse_event
from tokenmill.server.http.state import State
from tokenmill.server.shared.generation import Generation, until_disconnected
from tokenmill.server.shared.params import sampling_params

router = APIRouter()

# engine parameter name -> this route's name for it (error ``param``)
ALIASES = {"prompt": "messages", "stop": "stop_sequences"}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, state: State) -> Response:
    arrival = time.monotonic()
    lora_name = state.check_model(body.model)
    prompt, tools = await _prompt(body, state)
    fields = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    fields["structured_outputs"] = tools.constraint
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    with engine_errors({**ALIASES, "structured_outputs": "tools"}):
        params = sampling_params(fields, body.max_tokens)
        start = Generation.start(state, [prompt], [params], rid, arrival, lora_name)
        generation = await until_disconnected(request, start)
    if body.stream:
        return SSEResponse(_events(generation, rid, body.model, tools.names), on_close=generation.close)
    try:
        (output,) = await until_disconnected(request, generation.collect())
    finally:
        generation.close()
    out = output.outputs[0]
    if out.error:
        raise APIError(500, f"generation failed (request {rid}): {out.error}")
    if out.finish_reason == FinishReason.ABORT.value:
        raise APIError(503, _aborted(rid))
    message = _message(rid, body.model, output)
    message["content"], calls = content_blocks(out.text, tools.names)
    message.update(_stop(out, calls))
    message["usage"]["output_tokens"] = len(out.token_ids)
    return await json_response(message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesPromptRequest, state: State) -> Response:
    """The prompt's tokens as ``/v1/messages`` would build them from the same body."""
    state.check_model(body.model, runner=None)
    prompt, _ = await _prompt(body, state, counting=True)
    return JSONResponse({"input_tokens": len(prompt)})


async def _prompt(body: MessagesPromptRequest, state: State, counting: bool = False) -> tuple[list[int], ToolUse]:
    """The token ids of the body's system prompt, messages and tools through the chat template, and
    what its tools mean for the output (``counting``: for ``count_tokens``, on the counting pool)."""
    run = state.async_engine.run_counting if counting else state.async_engine.run_tokenizer
    with engine_errors(ALIASES):
        chat_template = state.tokenizer.hf.chat_template  # a forced call's grammar is built off the event loop
        tools = await run(lambda: tool_use(body, chat_template))
    messages = template_messages(body.system, body.messages)
    return await state.render_chat(messages, tools.tools, counting=counting), tools


def _usage(output: RequestOutput) -> dict[str, int]:
    """The prompt's tokens split as Anthropic reports them (see the module docstring)."""
    cached = output.num_cached_tokens
    return {
        "input_tokens": len(output.prompt_token_ids) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _message(rid: str, model: str, output: RequestOutput) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**_usage(output), "output_tokens": 0},
    }


def _aborted(rid: str) -> str:
    return f"request {rid} was aborted by the server before it finished (shutdown or an admin abort); retry"


def _stop(out: CompletionOutput, calls_tools: bool) -> dict[str, Any]:
    if calls_tools:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if out.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(out.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _event(data: dict[str, Any]) -> str:
    return sse_event(data, event=data["type"])


async def _events(generation: Generation, rid: str, model: str, tool_names: set[str] | None) -> AsyncIterator[str]:
    started = False
    output_tokens = 0
    blocks = ContentBlockStream(tool_names)
    async for _, delta in generation:
        if not started:
            started = True
            yield _event({"type": "message_start", "message": _message(rid, model, delta)})
            for event in blocks.start():
                yield _event(event)
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
            for event in blocks.feed(out.text):
                yield _event(event)
            if out.finish_reason is not None:
                closing, calls_tools = blocks.finish()
                for event in closing:
                    yield _event(event)
                usage = {**_usage(delta), "output_tokens": output_tokens}
                yield _event({"type": "message_delta", "delta": _stop(out, calls_tools), "usage": usage})
                yield _event({"type": "message_stop"})
