"""OpenAI-compatible API: ``GET /v1/models`` and what the chat and completions routes share.

The routes: :mod:`tokenmill.server.openai_chat` (``POST /v1/chat/completions``) and
:mod:`tokenmill.server.openai_completions` (``POST /v1/completions``).

- ``max_tokens`` unset: chat runs to the context limit (or ``max_tokens_cap``), completions
  default to 16 as in OpenAI's API.
- ``usage`` counts real tokens: each prompt once, completion tokens over all choices, and in
  ``prompt_tokens_details.cached_tokens`` the prompt tokens the prefix cache served.
- Streamed, each choice's ``finish_reason`` comes in a chunk of its own with no text, as OpenAI
  sends it: a client that stops at the first ``finish_reason`` has all the text.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter

from tokenmill.request import Logprob, RequestOutput
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import FunctionName
from tokenmill.server.sse import sse_event
from tokenmill.server.state import ServerState, State

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    model = {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "tokenmill",
        "max_model_len": state.engine.max_context_len,
    }
    return {"object": "list", "data": [model]}


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely entries of one token's logprobs, most likely first."""
    return sorted(entry.items(), key=lambda item: -item[1].logprob)[:k]


async def prompt_logprobs_json(
    state: ServerState, entries: list[dict[int, Logprob] | None] | None
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None) token id -> logprob, rank, decoded token."""
    if entries is None:
        return None
    strings = await state.token_strings([t for entry in entries if entry for t in entry])
    return [
        None
        if entry is None
        else {t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": strings[t]} for t, lp in entry.items()}
        for entry in entries
    ]


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def raise_on_error(output: RequestOutput) -> None:
    """APIError(500) naming the engine's error if a choice of ``output`` failed."""
    failed = next((o.error for o in output.outputs if o.error), None)
    if failed:
        raise APIError(500, f"generation failed (request {output.request_id}): {failed}", code="engine_error")


def stream_error(request_id: str, message: str) -> str:
    """The SSE event that reports a generation failure mid-stream."""
    error = {
        "message": f"generation failed (request {request_id}): {message}",
        "type": "server_error",
        "param": None,
        "code": "engine_error",
    }
    return sse_event({"error": error})


def completion_object(
    kind: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A (chat) completion or chunk object: ``kind`` is its ``object`` field; ``usage`` only when given."""
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def tool_setup(
    tools: list[dict[str, Any]], choice: str | FunctionName | None
) -> tuple[list[dict[str, Any]] | None, set[str] | None]:
    """Tools to render in the prompt, and the names of the tools whose calls are parsed (None: no parsing).

    ``tools`` are in the chat template's form (``{"type": "function", "function": {"name", ...}}``);
    ``choice`` is ``tool_choice``: "none", "auto" (also None), "required", or a named function.
    """
    choice = choice or "auto"
    if not tools:
        if choice not in ("auto", "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    if choice == "none":
        return None, None
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, str):
        return tools, names
    if choice.name not in names:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools", param="tool_choice")
    return tools, {choice.name}


def json_object_or_text(arguments: str) -> Any:
    """Tool-call arguments as chat templates expect them: a JSON object as a dict, anything else as its text."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:  # not JSON: keep the text (its depth is bounded: ``FunctionCall``)
        return arguments
    return value if isinstance(value, dict) else arguments
