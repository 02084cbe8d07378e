"""OpenAI (legacy) completions: ``POST /v1/completions``.

``prompt`` is a string, a list of strings, token ids or a list of token-id lists; each prompt is
one engine request with ``n`` choices (choice index = prompt index * n + i). ``echo`` and
``suffix`` are refused. Without ``max_tokens`` a completion stops at 16 tokens, as in OpenAI's API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.request import CompletionOutput, RequestOutput
from tokenmill.server.errors import APIError, engine_errors
from tokenmill.server.generation import Generation, until_disconnected
from tokenmill.server.openai import completion_object, raise_on_error, stream_error, top_logprobs, usage_json
from tokenmill.server.params import openai_params
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.sse import SSEResponse, sse_event
from tokenmill.server.state import ServerState, State

router = APIRouter()

COMPLETION_DEFAULT_MAX_TOKENS = 16


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    arrival = time.monotonic()
    state.check_model(body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = await _completion_prompts(state, body.prompt)
    config = state.engine.config
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, config.max_tokens_cap or COMPLETION_DEFAULT_MAX_TOKENS)
    rid = f"cmpl-{uuid.uuid4().hex}"
    with engine_errors({}):
        params = openai_params(body, max_tokens, body.logprobs)
        generation = await until_disconnected(
            request, Generation.start(state, prompts, [params] * len(prompts), rid, arrival)
        )
    completion = _Completion(state, rid, params.n, len(prompts))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(completion.events(generation, include_usage), on_close=generation.close)
    try:
        outputs = await until_disconnected(request, generation.collect())
    finally:
        generation.close()
    return JSONResponse(await completion.response(outputs))


async def _completion_prompts(
    state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """Token ids of each prompt (strings are tokenized in a worker thread)."""
    if isinstance(prompt, str):
        return await state.encode([prompt])
    if prompt and all(isinstance(p, str) for p in prompt):
        return await state.encode(prompt)  # type: ignore[arg-type]
    if prompt and isinstance(prompt[0], list):
        return prompt  # type: ignore[return-value]
    return [prompt]  # type: ignore[list-item]


class _Completion:
    """Formats one completions call's outputs, as a whole or as chunks."""

    def __init__(self, state: ServerState, request_id: str, n: int, n_prompts: int) -> None:
        self.state = state
        self.id = request_id
        self.n = n
        self.created = int(time.time())
        self._offsets = [0] * (n * n_prompts)  # text_offset reached so far, per choice

    async def _logprobs(self, choice: int, out: CompletionOutput) -> dict[str, Any] | None:
        """Legacy shape; ``text_offset`` is cumulative over the choice's token strings."""
        if out.logprobs is None:
            return None
        strings = await self.state.token_strings([t for entry in out.logprobs for t in entry])
        tokens = [strings[t] for t in out.token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self._offsets[choice])
            self._offsets[choice] += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)],
            "top_logprobs": [
                {strings[t]: lp.logprob for t, lp in top_logprobs(entry, len(entry))} for entry in out.logprobs
            ],
            "text_offset": offsets,
        }

    async def _choice(self, prompt_index: int, out: CompletionOutput) -> dict[str, Any]:
        index = prompt_index * self.n + out.index
        return {
            "index": index,
            "text": out.text,
            "logprobs": await self._logprobs(index, out),
            "finish_reason": out.finish_reason,
        }

    def _body(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        return completion_object("text_completion", self.id, self.created, self.state.model_name, choices, usage)

    async def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        for output in outputs:
            raise_on_error(output)
        choices = [await self._choice(i, out) for i, output in enumerate(outputs) for out in output.outputs]
        usage = usage_json(
            sum(len(o.prompt_token_ids) for o in outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs)
        )
        return self._body(choices, usage)

    async def events(self, generation: Generation, include_usage: bool) -> AsyncIterator[str]:
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        async for prompt_index, delta in generation:
            prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
            for out in delta.outputs:
                if out.error:
                    yield stream_error(self.id, out.error)
                    yield sse_event("[DONE]")
                    return
                completion_tokens += len(out.token_ids)
                if out.text or out.finish_reason or out.logprobs:
                    yield sse_event(self._body([await self._choice(prompt_index, out)], None))
        if include_usage:
            yield sse_event(self._body([], usage_json(sum(prompt_tokens.values()), completion_tokens)))
        yield sse_event("[DONE]")
