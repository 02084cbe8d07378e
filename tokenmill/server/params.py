"""Request fields -> SamplingParams.

Only fields the client set are passed; the rest keep SamplingParams' (vLLM's) defaults. Values
and the operator's caps are checked by the engine at intake (``SamplingParams.validate``).
"""

from __future__ import annotations

from typing import Any

from tokenmill.request import ParameterError, SamplingParams
from tokenmill.server.protocol import OpenAISampling

_OPENAI_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
)


def sampling_params(fields: dict[str, Any], max_tokens: int | None, logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the non-None ``fields``; ``max_tokens=None`` means "up to the context limit"."""
    given = {k: v for k, v in fields.items() if v is not None}
    return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs)


def openai_params(body: OpenAISampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """SamplingParams of an OpenAI request (``logit_bias`` keys are token ids as strings)."""
    fields = {name: getattr(body, name) for name in _OPENAI_FIELDS}
    if body.logit_bias:
        try:
            fields["logit_bias"] = {int(token): bias for token, bias in body.logit_bias.items()}
        except ValueError as exc:
            raise ParameterError("logit_bias", f"keys must be token ids, got {list(body.logit_bias)}") from exc
    return sampling_params(fields, max_tokens, logprobs)
