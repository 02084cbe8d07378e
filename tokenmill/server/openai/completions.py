"""OpenAI (legacy) completions: ``POST /v1/completions``.

``prompt`` is a string, a list of strings, token ids or a list of token-id lists; each prompt is
one engine request with ``n`` choices (choice index = prompt index * n + i). ``suffix`` is
refused. ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` constrain the output
as in chat completions (:mod:`tokenmill.server.openai.params`). Without ``max_tokens`` a completion
stops at 16 tokens, as in OpenAI's API.

``echo``: each choice's text (its first chunk, when streamed) starts with the prompt (a string
prompt as given, token ids decoded); with ``logprobs`` the prompt's tokens lead ``logprobs`` too,
the first with ``None``, as in OpenAI's legacy API (the engine computes them as
``prompt_logprobs=logprobs``). vLLM's ``prompt_logprobs=k`` adds a choice's ``prompt_logprobs``
(per prompt token, the first None: token id -> ``logprob``, ``rank``, ``decoded_token``).
"""

from __future__ import annotations

import asyncio
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
from tokenmill.server.openai.protocol import CompletionRequest
from tokenmill.server.shared.generation import Generation, until_disconnected
from tokenmill.server.shared.params import with_constraint_name

router = APIRouter()

COMPLETION_DEFAULT_MAX_TOKENS = 16


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    arrival = time.monotonic()
    lora_name = state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    with engine_errors({}):
        constraint = structured_outputs(body)
    config = state.engine.config
    many = isinstance(body.prompt, list) and bool(body.prompt) and isinstance(body.prompt[0], (str, list))
    n_prompts = len(body.prompt) if many else 1
    if n_prompts > max(1, config.max_waiting_requests):  # could never all be queued: refused before tokenizing
        raise APIError(
            400,
            f"prompt holds {n_prompts} prompts; one call may hold at most {config.max_waiting_requests} "
            "(the server's max_waiting_requests)",
            param="prompt",
        )
    prompts = await _completion_prompts(state, body.prompt)
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, config.max_tokens_cap or COMPLETION_DEFAULT_MAX_TOKENS)
    rid = f"cmpl-{uuid.uuid4().hex}"
    with engine_errors(with_constraint_name({}, constraint)):
        params = openai_params(body, max_tokens, body.logprobs, constraint)
        if body.echo and body.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = body.logprobs  # the echoed prompt's tokens get logprobs too
        generation = await until_disconnected(
            request, Generation.start(state, prompts, [params] * len(prompts), rid, arrival, lora_name)
        )
    echoed = await _echo_texts(state, body.prompt, prompts) if body.echo else None
    completion = _Completion(state, rid, params.n, prompts, echoed, body.model)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(completion.events(generation, include_usage), on_close=generation.close)
    try:
        outputs = await until_disconnected(request, generation.collect())
    finally:
        generation.close()
    return await json_response(await completion.response(outputs))


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


async def _echo_texts(
    state: ServerState, prompt: str | list[str] | list[int] | list[list[int]], ids: list[list[int]]
) -> list[str]:
    """The text ``echo`` repeats, per prompt: string prompts as given, token-id prompts decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    return await asyncio.to_thread(lambda: [state.tokenizer.decode(p) for p in ids])


class _Completion:
    """Formats one completions call's outputs, as a whole or as chunks. A choice's first chunk
    carries the echoed prompt (text and legacy logprobs) and ``prompt_logprobs``."""

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        n: int,
        prompts: list[list[int]],
        echoed: list[str] | None,
        model: str,
    ) -> None:
        self.state = state
        self.model = model  # as the request named it: the served model or one of its LoRA adapters
        self.id = request_id
        self.n = n
        self.created = int(time.time())
        self._prompts = prompts
        self._echoed = echoed
        self._prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = {}  # per prompt, once sent
        self._offsets = [0] * (n * len(prompts))  # text_offset reached so far, per choice
        self._started = [False] * (n * len(prompts))  # per choice: its first chunk went out

    async def _logprobs(self, choice: int, prompt_index: int, out: CompletionOutput) -> dict[str, Any] | None:
        """Legacy shape, the echoed prompt's tokens first; ``text_offset`` is cumulative over the
        choice's token strings."""
        if out.logprobs is None:
            return None
        ids = list(out.token_ids)
        entries: list[dict[int, Logprob] | None] = list(out.logprobs)
        if self._echoed is not None and not self._started[choice]:
            prompt = self._prompts[prompt_index]
            ids = prompt + ids
            entries = self._prompt_logprobs.get(prompt_index, [None] * len(prompt)) + entries
        strings = await self.state.token_strings(ids + [t for entry in entries if entry for t in entry])
        tokens = [strings[t] for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(self._offsets[choice])
            self._offsets[choice] += len(text)

        def build() -> dict[str, Any]:
            return {
                "tokens": tokens,
                "token_logprobs": [None if entry is None else entry[t].logprob for t, entry in zip(ids, entries)],
                "top_logprobs": [
                    None if entry is None else {strings[t]: lp.logprob for t, lp in top_logprobs(entry, len(entry))}
                    for entry in entries
                ],
                "text_offset": offsets,
            }

        return await build_off_loop(build)  # megabytes of objects: off the event loop

    async def _choice(self, prompt_index: int, out: CompletionOutput) -> dict[str, Any]:
        index = prompt_index * self.n + out.index
        first = not self._started[index]
        choice = {
            "index": index,
            "text": (self._echoed[prompt_index] if self._echoed is not None and first else "") + out.text,
            "logprobs": await self._logprobs(index, prompt_index, out),
            "finish_reason": out.finish_reason,
        }
        if first and prompt_index in self._prompt_logprobs:
            choice["prompt_logprobs"] = await prompt_logprobs_json(self.state, self._prompt_logprobs[prompt_index])
        self._started[index] = True
        return choice

    def _body(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return completion_object("text_completion", self.id, self.created, self.model, choices, usage)

    async def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        for prompt_index, output in enumerate(outputs):
            raise_on_error(output)
            if output.prompt_logprobs is not None:
                self._prompt_logprobs[prompt_index] = output.prompt_logprobs
        choices = [await self._choice(i, out) for i, output in enumerate(outputs) for out in output.outputs]
        usage = usage_json(
            sum(len(o.prompt_token_ids) for o in outputs),
            sum(len(c.token_ids) for o in outputs for c in o.outputs),
            sum(o.num_cached_tokens for o in outputs),
        )
        return self._body(choices, usage)

    async def events(self, generation: Generation, include_usage: bool) -> AsyncIterator[str]:
        """The SSE stream: text chunks, each choice's ``finish_reason`` in a chunk of its own with
        empty text (as OpenAI sends it), usage, ``[DONE]``."""
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}  # per prompt, its first delta's, as in a whole reply (``accumulate``)
        completion_tokens = 0
        async for prompt_index, delta in generation:
            prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
            cached_tokens.setdefault(prompt_index, delta.num_cached_tokens)
            if delta.prompt_logprobs is not None:
                self._prompt_logprobs[prompt_index] = delta.prompt_logprobs
            for out in delta.outputs:
                if out.error:
                    yield stream_error(self.id, out.error)
                    yield sse_event("[DONE]")
                    return
                completion_tokens += len(out.token_ids)
                if not (out.text or out.finish_reason or out.logprobs):
                    continue
                choice = await self._choice(prompt_index, out)
                logprobs = choice["logprobs"]
                if choice["text"] or (logprobs and logprobs["tokens"]) or "prompt_logprobs" in choice:
                    yield sse_event(self._body([{**choice, "finish_reason": None}], None))
                if out.finish_reason:
                    end = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": out.finish_reason}
                    yield sse_event(self._body([end], None))
        if include_usage:
            usage = usage_json(sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values()))
            yield sse_event(self._body([], usage))
        yield sse_event("[DONE]")
