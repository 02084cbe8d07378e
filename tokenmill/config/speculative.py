"""SpeculativeOptions: the ``speculative_config`` setting (vLLM's keys), checked by
``speculative_config.py``'s :class:`~tokenmill.speculative_config.SpeculativeConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config.options import option
from tokenmill.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class SpeculativeOptions:
    """The speculative-decoding group of :class:`~tokenmill.config.EngineConfig`."""

    speculative_config: dict[str, Any] | None = option(
        None,
        'Speculative decoding, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 5, '
        '"prompt_lookup_max": 5, "prompt_lookup_min": 3} (prompt lookup; those bounds are the defaults) or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a smaller model with the same '
        'vocabulary); "disable_by_batch_size": speculate only up to this many decoding sequences (default: '
        "measured). None: off.",
        section="Speculative decoding",
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        self.speculative()  # raises on a bad setting

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` validated (raises ValueError naming the bad key), or None when off."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
