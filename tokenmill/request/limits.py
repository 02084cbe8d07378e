"""RequestLimits: what the engine accepts, the bounds a request's parameters are validated against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """What the engine accepts: the model's vocabulary and the operator's caps (None: no cap)."""

    vocab_size: int
    max_n: int | None = None
    max_tokens_cap: int | None = None
    max_top_logprobs: int | None = None
    max_stop_strings: int | None = None
    max_stop_chars: int | None = None
    max_stop_token_ids: int | None = None
    max_structured_output_chars: int | None = None
