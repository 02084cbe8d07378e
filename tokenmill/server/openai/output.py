"""What the OpenAI routes answer with: usage, logprobs and (chat) completion objects, and a failed
generation as an error (500, or an event mid-stream)."""

from __future__ import annotations

from typing import Any

from tokenmill.request import Logprob, RequestOutput
from tokenmill.server.http.errors import APIError
from tokenmill.server.http.sse import sse_event
from tokenmill.server.http.state import ServerState


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
    """OpenAI's ``usage`` object; ``cached_tokens``: prompt tokens served from a KV cache tier (device or disk)."""
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
