"""Requests and their results: SamplingParams (validated against RequestLimits), RequestOutput,
CompletionOutput, and ParameterError, the one error type for a refused request parameter.

Names and defaults follow vLLM so users can switch engines without relearning the API.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (e.g. the client went away)
    ERROR = "error"  # the engine failed this request; ``CompletionOutput.error`` says why


GREEDY_TEMPERATURE = 1e-5
INT63 = 2**63


class ParameterError(ValueError):
    """A refused request parameter; ``param`` names it, and the message starts with that name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


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


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParameterError(param, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """Per-request generation parameters (vLLM names and defaults).

    ``temperature == 0`` (or below 1e-5) is exact greedy argmax. ``top_k <= 0`` disables top-k. ``logprobs=k``
    returns the chosen token's logprob plus the ``k`` most likely (k=0: only the chosen one),
    computed from the model's log-softmax before any sampling transform.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` are exact argmax (as in vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, limits: RequestLimits) -> None:
        """Raise :class:`ParameterError` naming the first bad parameter (type, range or cap)."""
        ints = ("n", "top_k", "min_tokens")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in ints:
            _require(_is_int(getattr(self, name)), name, f"must be an integer, got {getattr(self, name)!r}")
        for name in floats:
            _require(_is_number(getattr(self, name)), name, f"must be a finite number, got {getattr(self, name)!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), name, f"must be an integer or None, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, f"must be a boolean, got {getattr(self, name)!r}")
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(limits.max_n is None or self.n <= limits.max_n, "n", f"must be <= {limits.max_n}, got {self.n}")
        _require(
            -1 <= self.top_k < 2**31,
            "top_k",
            f"must be -1 or 0 (disabled) or a positive count below 2**31, got {self.top_k}",
        )
        _require(self.seed is None or 0 <= self.seed < INT63, "seed", f"must be in [0, 2**63), got {self.seed}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(
            1e-3 <= self.repetition_penalty <= 1e3,
            "repetition_penalty",
            f"must be in [0.001, 1000], got {self.repetition_penalty}",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
            cap = limits.max_tokens_cap
            _require(cap is None or self.max_tokens <= cap, "max_tokens", f"must be <= {cap}, got {self.max_tokens}")
        _require(
            self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "min_tokens",
            f"must be in [0, max_tokens], got {self.min_tokens}",
        )
        vocab_size = limits.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or 0 <= value <= vocab_size, name, f"must be in [0, {vocab_size}], got {value}")
            cap = limits.max_top_logprobs
            _require(value is None or cap is None or value <= cap, name, f"must be <= {cap}, got {value}")
        # Counts are checked before anything walks a list, and messages never echo a whole list.
        _require(self.stop is None or isinstance(self.stop, list), "stop", "must be a string or a list of strings")
        cap = limits.max_stop_strings
        _require(
            cap is None or len(self.stop_strings) <= cap,
            "stop",
            f"may hold at most {cap} strings, got {len(self.stop_strings)}",
        )
        empty_or_not_str = [s for s in self.stop_strings if not (isinstance(s, str) and s)]
        _require(not empty_or_not_str, "stop", f"must hold non-empty strings, got {empty_or_not_str[:1]!r}")
        cap, chars = limits.max_stop_chars, sum(len(s) for s in self.stop_strings)
        _require(cap is None or chars <= cap, "stop", f"may hold at most {cap} characters in all, got {chars}")
        if self.stop_token_ids is not None:
            _require(isinstance(self.stop_token_ids, list), "stop_token_ids", "must be a list of integers")
            cap = limits.max_stop_token_ids
            _require(
                cap is None or len(self.stop_token_ids) <= cap,
                "stop_token_ids",
                f"may hold at most {cap} token ids, got {len(self.stop_token_ids)}",
            )
            not_int = [t for t in self.stop_token_ids if not _is_int(t)]
            _require(not not_int, "stop_token_ids", f"must be a list of integers, got {not_int[:1]!r}")
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            _require(not bad, "stop_token_ids", f"{bad} are outside the vocabulary [0, {vocab_size})")
        if self.logit_bias is not None:
            _require(
                isinstance(self.logit_bias, dict),
                "logit_bias",
                f"must be a mapping of token id to bias, got {self.logit_bias!r}",
            )
            for token, bias in self.logit_bias.items():
                _require(
                    _is_int(token) and 0 <= token < vocab_size,
                    "logit_bias",
                    f"token id {token!r} is outside the vocabulary [0, {vocab_size})",
                )
                _require(
                    _is_number(bias) and -100 <= bias <= 100,
                    "logit_bias",
                    f"value for token {token} must be in [-100, 100], got {bias!r}",
                )


LOGPROB_FLOOR = -9999.0
"""The lowest logprob reported: -inf (a zero probability) and NaN (non-finite logits, e.g. after a
bad weight update) read as this, so a logprob is always a number JSON can carry."""


@dataclass
class Logprob:
    """Log-probability of one token, with its rank (1 = most likely) under the model; always finite:
    at least :data:`LOGPROB_FLOOR` (what a zero probability or a non-finite model output reads as)."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request. In a streamed delta, text/token_ids are the new part."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    weight_versions: list[int] = field(default_factory=list)  # weight version that produced each token

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0


OutputCallback = Callable[[RequestOutput], None]


def now() -> float:
    return time.monotonic()


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a streamed delta into the cumulative output of a request (returns the new total)."""
    if total is None:
        total = RequestOutput(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[],
            finished=False,
            metrics=delta.metrics,
            prompt_logprobs=delta.prompt_logprobs,
            num_cached_tokens=delta.num_cached_tokens,
        )
    by_index = {c.index: c for c in total.outputs}
    for part in delta.outputs:
        acc = by_index.get(part.index)
        if acc is None:
            acc = by_index[part.index] = CompletionOutput(
                index=part.index, logprobs=[] if part.logprobs is not None else None
            )
        acc.text += part.text
        acc.token_ids += part.token_ids
        acc.weight_versions += part.weight_versions
        if part.logprobs is not None and acc.logprobs is not None:
            acc.logprobs += part.logprobs
        acc.finish_reason, acc.stop_reason, acc.error = part.finish_reason, part.stop_reason, part.error
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.metrics = delta.metrics
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    return total
