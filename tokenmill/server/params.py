"""Request fields -> SamplingParams, with the server-side caps of EngineConfig.

Only fields the client set are passed; the rest keep SamplingParams' (vLLM's) defaults. Ranges
are checked by the engine when the request is added; the caps here (``max_top_logprobs``,
``max_stop_strings``, ``max_tokens_cap``; the engine enforces ``max_n``) are the server's limits, and
break them the way the engine reports bad input: a ValueError whose message starts with the
parameter's name (see :func:`tokenmill.server.errors.engine_errors`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.request import SamplingParams
from tokenmill.server.protocol import OpenAISampling

_OPENAI_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "seed", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
)


def sampling_params(
    config: EngineConfig, fields: dict[str, Any], max_tokens: int | None, logprobs: int | None = None
) -> SamplingParams:
    """SamplingParams from the non-None ``fields``; ``max_tokens=None`` means "up to the context limit".

    Raises ValueError when a cap of ``config`` is exceeded.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if len(given.get("stop", ())) > config.max_stop_strings:
        raise ValueError(f"stop may hold at most {config.max_stop_strings} strings, got {len(given['stop'])}")
    if logprobs is not None and logprobs > config.max_top_logprobs:
        raise ValueError(f"logprobs must be <= {config.max_top_logprobs}, got {logprobs}")
    cap = config.max_tokens_cap
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise ValueError(f"max_tokens must be <= {cap}, got {max_tokens}")
    return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs)


def openai_params(
    config: EngineConfig, body: OpenAISampling, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """SamplingParams of an OpenAI request (``logit_bias`` keys are token ids as strings)."""
    fields = {name: getattr(body, name) for name in _OPENAI_FIELDS}
    if body.logit_bias:
        try:
            fields["logit_bias"] = {int(token): bias for token, bias in body.logit_bias.items()}
        except ValueError as exc:
            raise ValueError(f"logit_bias keys must be token ids, got {list(body.logit_bias)}") from exc
    return sampling_params(config, fields, max_tokens, logprobs)


def fit_to_context(params: SamplingParams, prompt_len: int, config: EngineConfig, context_len: int) -> SamplingParams:
    """With ``max_tokens`` unset and ``max_tokens_cap`` set: the cap, or less to fit the context."""
    if params.max_tokens is not None or config.max_tokens_cap is None:
        return params
    return dataclasses.replace(params, max_tokens=max(1, min(config.max_tokens_cap, context_len - prompt_len)))
