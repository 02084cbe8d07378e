"""LimitOptions: the caps every request is checked against, and the work intake may do for one."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.options import at_least, option
from tokenmill.request import RequestLimits


@dataclass(frozen=True)
class LimitOptions:
    """The request-caps group of :class:`~tokenmill.config.EngineConfig` (checked by
    ``SamplingParams.validate`` for every request, API and server alike)."""

    max_n: int = option(16, "Most completions per request.", section="Request caps")
    max_tokens_cap: int | None = option(
        None,
        "Most output tokens per request; a request without max_tokens gets this (or less, to fit).",
        section="Request caps",
    )
    max_top_logprobs: int = option(
        20,
        "Most alternatives per token in logprobs / prompt_logprobs.",
        section="Request caps",
    )
    max_stop_strings: int = option(16, "Most stop strings per request.", section="Request caps")
    max_stop_chars: int = option(
        2048,
        "Most characters in all of a request's stop strings together (bounds the stop-string matching "
        "state and the streaming hold-back, which is shorter than the longest stop string).",
        section="Request caps",
    )
    max_stop_token_ids: int = option(
        64,
        "Most entries in a request's ``stop_token_ids`` (checked as a set built once per sequence).",
        section="Request caps",
    )
    max_structured_output_chars: int = option(
        32_768,
        "Most characters in a request's ``structured_outputs`` spec (a schema counts as its compact JSON "
        "text; choices as their total length): bounds the grammar compile time and memory.",
        section="Request caps",
    )
    structured_output_compile_timeout: float = option(
        10.0,
        "Seconds a request's grammar may take to compile at intake before the request is refused "
        '(ParameterError "structured_outputs"). A compile cannot be interrupted: an overrunning one '
        "finishes in the background, and its result goes to the compile cache.",
        section="Request caps",
    )
    structured_output_cache_bytes: int = option(
        64 * 2**20,
        "Memory for compiled grammars kept for reuse (least recently used dropped first).",
        section="Request caps",
    )
    tokenizer_threads: int = option(
        4,
        "Threads that tokenize off the event loop (AsyncEngine and the HTTP server); more concurrent "
        "tokenizations wait for one of them instead of taking other worker threads.",
        section="Request caps",
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "max_n", "tokenizer_threads", "max_tokens_cap")
        at_least(
            self,
            0,
            "max_top_logprobs",
            "max_stop_strings",
            "max_stop_chars",
            "max_stop_token_ids",
            "max_structured_output_chars",
        )
        if not self.structured_output_compile_timeout > 0:
            raise ValueError(
                f"structured_output_compile_timeout must be > 0, got {self.structured_output_compile_timeout}"
            )
        if self.structured_output_cache_bytes < 0:
            raise ValueError(f"structured_output_cache_bytes must be >= 0, got {self.structured_output_cache_bytes}")

    def request_limits(self, vocab_size: int) -> RequestLimits:
        """The caps above, for a model with ``vocab_size`` tokens."""
        return RequestLimits(
            vocab_size,
            max_n=self.max_n,
            max_tokens_cap=self.max_tokens_cap,
            max_top_logprobs=self.max_top_logprobs,
            max_stop_strings=self.max_stop_strings,
            max_stop_chars=self.max_stop_chars,
            max_stop_token_ids=self.max_stop_token_ids,
            max_structured_output_chars=self.max_structured_output_chars,
        )
