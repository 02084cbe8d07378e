"""SchedulerOptions: how many requests run and wait, how long they may be, a step's token budget."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.options import at_least, option


@dataclass(frozen=True)
class SchedulerOptions:
    """The batching group of :class:`~tokenmill.config.EngineConfig`."""

    max_running_requests: int = option(
        128,
        "Rows in the request-to-token table: the most requests running at once.",
        section="Batching",
    )
    max_context_len: int | None = option(
        None,
        "Longest prompt + output; None means the model's limit.",
        section="Batching",
    )
    max_num_batched_tokens: int = option(
        2048,
        "Per-step token budget: prefill chunks plus decode tokens in one forward.",
        section="Batching",
    )
    max_waiting_requests: int = option(
        4096,
        "Bound on the waiting queue; new requests beyond it are refused.",
        section="Batching",
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "max_running_requests", "max_num_batched_tokens")
