"""OpenAI chat completions: ``POST /v1/chat/completions``.

Messages go through the model's chat template (in a worker thread); ``tools`` are passed to it
unless ``tool_choice`` is "none", and the output is parsed for tool calls
(:mod:`tokenmill.server.shared.tool_parser`). ``tool_choice`` "required" or a named function constrains
the output to one call (:mod:`tokenmill.server.shared.tool_constraint`); ``response_format`` and vLLM's
``structured_outputs`` / ``guided_*`` constrain it otherwise (:mod:`tokenmill.server.openai.params`).
Output cut short by ``max_tokens`` before a call is complete is returned as plain content.
Without ``max_tokens`` a reply runs to the context limit (or ``max_tokens_cap``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.request import CompletionOutput, Logprob, RequestOutput
from tokenmill.server.http.errors import APIError, engine_errors
from tokenmill.server.http.json_body import build_off_loop, json_response
from tokenmill.server.http.sse import SSEResponse, sse_event
from tokenmill.server.http.state import ServerState, State
from tokenmill.server.openai.output import (
    completion_object,
    prompt_logprobs_json,
    raise_on_error,
    stream_error,
    top_logprobs,
    usage_json,
)
from tokenmill.server.openai.params import openai_params, structured_outputs
from tokenmill.server.openai.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from tokenmill.server.shared.content_text import joined_text
from tokenmill.server.shared.generation import Generation, until_disconnected
from tokenmill.server.shared.params import with_constraint_name
from tokenmill.server.shared.tool_constraint import output_constraint
from tokenmill.server.shared.tool_parser import ToolCall, ToolCallStream, parse_tool_calls
from tokenmill.server.shared.tools import json_object_or_text, tool_setup

router = APIRouter()

# engine parameter name -> this route's name for it (error ``param``)
CHAT_ALIASES = {"prompt": "messages", "logprobs": "top_logprobs"}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    arrival = time.monotonic()
    lora_name = state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    choice = body.tool_choice.function if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    tools, tool_names = tool_setup([t.model_dump(exclude_none=True) for t in body.tools or []], choice)
    with engine_errors(CHAT_ALIASES):
        given, chat_template = structured_outputs(body), state.tokenizer.hf.chat_template
        constraint = await state.async_engine.run_tokenizer(  # a forced call's grammar is built off the event loop
            lambda: output_constraint(given, tools, tool_names, body.tool_choice, chat_template)
        )
    prompt = await state.render_chat([template_message(m) for m in body.messages], tools)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    with engine_errors(with_constraint_name(CHAT_ALIASES, constraint)):
        params = openai_params(body, max_tokens, logprobs, constraint)
        start = Generation.start(state, [prompt], [params], rid, arrival, lora_name)
        generation = await until_disconnected(request, start)
    chat = _Chat(state, rid, tool_names, logprobs, body.model)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(chat.events(generation, params.n, include_usage), on_close=generation.close)
    try:
        (output,) = await until_disconnected(request, generation.collect())
    finally:
        generation.close()
    return await json_response(await chat.response(output))


def template_message(message: ChatMessage) -> dict[str, Any]:
    """The message as chat templates expect it (tool-call arguments as objects, as in HF's docs)."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": joined_text(message.content, ("text",), "messages"),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": json_object_or_text(c.function.arguments)},
            }
            for c in message.tool_calls
        ]
    return out


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class _Chat:
    """Formats one chat completion's output, as a whole or as chunks."""

    def __init__(
        self, state: ServerState, request_id: str, tool_names: set[str] | None, logprobs: int | None, model: str
    ) -> None:
        self.state = state
        self.model = model  # as the request named it: the served model or one of its LoRA adapters
        self.id = request_id
        self.tool_names = tool_names
        self.top_logprobs = logprobs
        self.created = int(time.time())

    async def _logprobs(self, out: CompletionOutput) -> dict[str, Any] | None:
        if self.top_logprobs is None or out.logprobs is None:
            return None
        strings = await self.state.token_strings([t for entry in out.logprobs for t in entry])
        k = self.top_logprobs

        def item(token: int, lp: Logprob) -> dict[str, Any]:
            text = strings[token]
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

        def build() -> dict[str, Any]:
            content = [
                {**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in top_logprobs(entry, k)]}
                for token, entry in zip(out.token_ids, out.logprobs)
            ]
            return {"content": content}

        return await build_off_loop(build)  # megabytes of objects: off the event loop

    async def response(self, output: RequestOutput) -> dict[str, Any]:
        raise_on_error(output)
        choices = []
        for out in output.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            finish = out.finish_reason
            parsed = parse_tool_calls(out.text, self.tool_names) if self.tool_names is not None else None
            if parsed and parsed.tool_calls:
                message = {
                    "role": "assistant",
                    "content": parsed.content.strip() or None,
                    "tool_calls": [_tool_call_json(c) for c in parsed.tool_calls],
                }
                finish = "tool_calls"
            choices.append(
                {"index": out.index, "message": message, "logprobs": await self._logprobs(out), "finish_reason": finish}
            )
        completion_tokens = sum(len(o.token_ids) for o in output.outputs)
        usage = usage_json(len(output.prompt_token_ids), completion_tokens, output.num_cached_tokens)
        body = completion_object("chat.completion", self.id, self.created, self.model, choices, usage)
        if output.prompt_logprobs is not None:  # vLLM's extension, at the top level
            body["prompt_logprobs"] = await prompt_logprobs_json(self.state, output.prompt_logprobs)
        return body

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        model = self.model
        return sse_event(completion_object("chat.completion.chunk", self.id, self.created, model, choices, usage))

    async def events(self, generation: Generation, n: int, include_usage: bool) -> AsyncIterator[str]:
        """The SSE stream: a role chunk per choice, content / tool-call deltas, each choice's
        ``finish_reason`` in a chunk of its own with an empty delta (as OpenAI sends it), usage, ``[DONE]``."""
        tool_streams = [ToolCallStream(self.tool_names) if self.tool_names is not None else None for _ in range(n)]
        for index in range(n):
            yield self._chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        prompt_tokens = completion_tokens = 0
        cached_tokens: int | None = None  # the first delta's, as in a whole reply (``accumulate``)
        async for _, delta in generation:
            prompt_tokens = len(delta.prompt_token_ids)
            cached_tokens = delta.num_cached_tokens if cached_tokens is None else cached_tokens
            if delta.prompt_logprobs is not None:  # vLLM's extension: a chunk of its own, without choices
                model, entries = self.model, delta.prompt_logprobs
                chunk = completion_object("chat.completion.chunk", self.id, self.created, model, [], None)
                yield sse_event({**chunk, "prompt_logprobs": await prompt_logprobs_json(self.state, entries)})
            for out in delta.outputs:
                if out.error:
                    yield stream_error(self.id, out.error)
                    yield sse_event("[DONE]")
                    return
                completion_tokens += len(out.token_ids)
                message, finish = self._delta(out, tool_streams[out.index])
                logprobs = await self._logprobs(out)
                if message or logprobs:
                    yield self._chunk(
                        [{"index": out.index, "delta": message, "logprobs": logprobs, "finish_reason": None}]
                    )
                if finish:
                    yield self._chunk([{"index": out.index, "delta": {}, "logprobs": None, "finish_reason": finish}])
        if include_usage:
            yield self._chunk([], usage_json(prompt_tokens, completion_tokens, cached_tokens or 0))
        yield sse_event("[DONE]")

    @staticmethod
    def _delta(out: CompletionOutput, tools: ToolCallStream | None) -> tuple[dict[str, Any], str | None]:
        """The chunk's ``delta`` and ``finish_reason`` for one choice's output delta."""
        if tools is None:
            return ({"content": out.text} if out.text else {}), out.finish_reason
        text, finish = tools.feed(out.text), out.finish_reason
        message: dict[str, Any] = {}
        if finish is not None:
            rest, calls = tools.finish()
            text += rest
            if calls:
                message["tool_calls"] = [{"index": i, **_tool_call_json(c)} for i, c in enumerate(calls)]
                finish = "tool_calls"
                text = text if text.strip() else ""  # as in a whole reply: no whitespace-only content
        if text:
            message["content"] = text
        return message, finish
