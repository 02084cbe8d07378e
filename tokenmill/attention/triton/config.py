"""TritonConfig: the Triton backend's tunables (built by the factory from ``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TritonConfig:
    """Tile and split sizes of the Triton kernels, and the decode rows its scratch holds."""

    prefill_q_tile: int
    """Query rows per tile of the ragged prefill kernel."""
    max_decode_splits: int
    """Cap on the KV splits per request of the split-KV decode kernel."""
    decode_split_min_tokens: int
    """A decode split covers at least this many context tokens."""
    max_rows: int
    """The most requests in one decode step (rows of the split-KV scratch)."""

    def __post_init__(self) -> None:
        for name in ("prefill_q_tile", "max_decode_splits", "decode_split_min_tokens", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
