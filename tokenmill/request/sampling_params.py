"""SamplingParams: one request's generation parameters (vLLM's names and defaults), validated
against :class:`~tokenmill.request.limits.RequestLimits`."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.request.checks import is_int, is_number, require
from tokenmill.request.limits import RequestLimits
from tokenmill.request.structured_outputs import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5
INT63 = 2**63


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
    structured_outputs: StructuredOutputsParams | None = None

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
        self._check_types()
        self._check_ranges(limits)
        self._check_logprobs(limits)
        self._check_stop(limits)
        self._check_stop_token_ids(limits)
        self._check_logit_bias(limits)
        self._check_structured_outputs(limits)

    def _check_types(self) -> None:
        """Each scalar parameter is of its type (before any range check compares it)."""
        ints = ("n", "top_k", "min_tokens")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in ints:
            require(is_int(getattr(self, name)), name, f"must be an integer, got {getattr(self, name)!r}")
        for name in floats:
            require(is_number(getattr(self, name)), name, f"must be a finite number, got {getattr(self, name)!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or is_int(value), name, f"must be an integer or None, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            require(isinstance(getattr(self, name), bool), name, f"must be a boolean, got {getattr(self, name)!r}")

    def _check_ranges(self, limits: RequestLimits) -> None:
        """The counts, the sampling transforms' parameters and the token bounds are in range."""
        require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        require(limits.max_n is None or self.n <= limits.max_n, "n", f"must be <= {limits.max_n}, got {self.n}")
        require(
            -1 <= self.top_k < 2**31,
            "top_k",
            f"must be -1 or 0 (disabled) or a positive count below 2**31, got {self.top_k}",
        )
        require(self.seed is None or 0 <= self.seed < INT63, "seed", f"must be in [0, 2**63), got {self.seed}")
        require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        require(
            1e-3 <= self.repetition_penalty <= 1e3,
            "repetition_penalty",
            f"must be in [0.001, 1000], got {self.repetition_penalty}",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            require(-2 <= getattr(self, name) <= 2, name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None:
            require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
            cap = limits.max_tokens_cap
            require(cap is None or self.max_tokens <= cap, "max_tokens", f"must be <= {cap}, got {self.max_tokens}")
        require(
            self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "min_tokens",
            f"must be in [0, max_tokens], got {self.min_tokens}",
        )

    def _check_logprobs(self, limits: RequestLimits) -> None:
        """``logprobs`` and ``prompt_logprobs`` ask for at most the vocabulary, and the cap."""
        vocab_size = limits.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or 0 <= value <= vocab_size, name, f"must be in [0, {vocab_size}], got {value}")
            cap = limits.max_top_logprobs
            require(value is None or cap is None or value <= cap, name, f"must be <= {cap}, got {value}")

    def _check_stop(self, limits: RequestLimits) -> None:
        """``stop``: a list of non-empty strings within the caps on their count and characters."""
        # Counts are checked before anything walks a list, and messages never echo a whole list.
        require(self.stop is None or isinstance(self.stop, list), "stop", "must be a string or a list of strings")
        cap = limits.max_stop_strings
        require(
            cap is None or len(self.stop_strings) <= cap,
            "stop",
            f"may hold at most {cap} strings, got {len(self.stop_strings)}",
        )
        empty_or_not_str = [s for s in self.stop_strings if not (isinstance(s, str) and s)]
        require(not empty_or_not_str, "stop", f"must hold non-empty strings, got {empty_or_not_str[:1]!r}")
        cap, chars = limits.max_stop_chars, sum(len(s) for s in self.stop_strings)
        require(cap is None or chars <= cap, "stop", f"may hold at most {cap} characters in all, got {chars}")

    def _check_stop_token_ids(self, limits: RequestLimits) -> None:
        """``stop_token_ids``: a list, within its cap, of token ids of the vocabulary."""
        if self.stop_token_ids is None:
            return
        vocab_size = limits.vocab_size
        require(isinstance(self.stop_token_ids, list), "stop_token_ids", "must be a list of integers")
        cap = limits.max_stop_token_ids
        require(
            cap is None or len(self.stop_token_ids) <= cap,
            "stop_token_ids",
            f"may hold at most {cap} token ids, got {len(self.stop_token_ids)}",
        )
        not_int = [t for t in self.stop_token_ids if not is_int(t)]
        require(not not_int, "stop_token_ids", f"must be a list of integers, got {not_int[:1]!r}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        require(not bad, "stop_token_ids", f"{bad} are outside the vocabulary [0, {vocab_size})")

    def _check_logit_bias(self, limits: RequestLimits) -> None:
        """``logit_bias``: a mapping of token ids of the vocabulary to biases in [-100, 100]."""
        if self.logit_bias is None:
            return
        vocab_size = limits.vocab_size
        require(
            isinstance(self.logit_bias, dict),
            "logit_bias",
            f"must be a mapping of token id to bias, got {self.logit_bias!r}",
        )
        for token, bias in self.logit_bias.items():
            require(
                is_int(token) and 0 <= token < vocab_size,
                "logit_bias",
                f"token id {token!r} is outside the vocabulary [0, {vocab_size})",
            )
            require(
                is_number(bias) and -100 <= bias <= 100,
                "logit_bias",
                f"value for token {token} must be in [-100, 100], got {bias!r}",
            )

    def _check_structured_outputs(self, limits: RequestLimits) -> None:
        """``structured_outputs``: a :class:`StructuredOutputsParams` that validates."""
        if self.structured_outputs is None:
            return
        require(
            isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            f"must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}",
        )
        self.structured_outputs.validate(limits.max_structured_output_chars)
