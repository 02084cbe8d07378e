"""SpeculativeConfig: how the engine guesses tokens ahead and verifies them (vLLM's names).

``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 3}``:
prompt lookup (no extra model; those n-gram bounds are the defaults). ``{"method": "draft_model",
"model": PATH, "num_speculative_tokens": 4}``: a smaller checkpoint with the target's vocabulary
proposes its greedy continuation (checked against the target when the engine starts).
``disable_by_batch_size``: speculate only while at most this many sequences decode in a step (None:
the engine's measured default). Every key is checked here, before anything is built: an unknown
key, method or out-of-range value is a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
"""Proposers the engine has."""
MAX_SPECULATIVE_TOKENS = 16
"""Most tokens proposed per sequence and step."""
MAX_LOOKUP = 64
"""Longest n-gram ``prompt_lookup_max`` may name."""
DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 3, 5
"""The n-gram lengths tried when the setting names none (longest first)."""
KEYS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding setting (see the module docstring)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    disable_by_batch_size: int | None = None
    model: str | None = None
    """The draft model's checkpoint (method draft_model only)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported; supported: {', '.join(METHODS)}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: 'model' (the draft checkpoint) goes with method 'draft_model' only")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config: model must be a checkpoint path, got {self.model!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, MAX_LOOKUP)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """The setting a user's dict names (``speculative_config``); raises ValueError on a bad one.
        Of the n-gram bounds, one given alone moves the other's default where it would cross it."""
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a JSON object / dict, got {type(values).__name__}")
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in values:
                raise ValueError(f"speculative_config needs {key!r}")
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if low is None:
            low = min(DEFAULT_LOOKUP_MIN, high) if isinstance(high, int) else DEFAULT_LOOKUP_MIN
        if high is None:
            high = max(DEFAULT_LOOKUP_MAX, low) if isinstance(low, int) else DEFAULT_LOOKUP_MAX
        return cls(
            values["method"],
            values["num_speculative_tokens"],
            low,
            high,
            values.get("disable_by_batch_size"),
            values.get("model"),
        )


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config: {name} must be an integer {bounds}, got {value!r}")
