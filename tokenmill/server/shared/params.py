"""Request fields -> SamplingParams, and a request's output constraint under the request's own name.

Only fields the client set are passed; the rest keep SamplingParams' (vLLM's) defaults. Values
and the operator's caps are checked by the engine at intake (``SamplingParams.validate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.request import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class OutputConstraint:
    """A request's constraint on its output, and the request's own name for the parameter that set it."""

    param: str
    spec: StructuredOutputsParams


def with_constraint_name(aliases: dict[str, str], constraint: OutputConstraint | None) -> dict[str, str]:
    """``aliases`` (engine parameter -> the route's name) plus the request's own name for its
    output constraint, so an engine refusal of the constraint names the parameter the client set."""
    return {**aliases, "structured_outputs": constraint.param} if constraint else aliases


def sampling_params(fields: dict[str, Any], max_tokens: int | None, logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the non-None ``fields``; ``max_tokens=None`` means "up to the context limit"."""
    given = {k: v for k, v in fields.items() if v is not None}
    return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs)
