"""ParallelOptions: how many processes the model is split over, and how long their collectives may take."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.options import at_least, option


@dataclass(frozen=True)
class ParallelOptions:
    """The tensor-parallel group of :class:`~tokenmill.config.EngineConfig`."""

    tensor_parallel_size: int = option(
        1,
        "Processes the model is split over (``tokenmill.distributed``): this one (rank 0: scheduler, "
        "cache bookkeeping, sampling) and ``tensor_parallel_size - 1`` workers it spawns (gloo on CPU, "
        "NCCL on GPU: one GPU each). 1 runs everything in this process.",
        section="Tensor parallelism",
    )
    distributed_timeout_s: float = option(
        60.0,
        "Seconds any collective of the tensor-parallel group may take before it fails (a worker that "
        "hangs or dies then fails the engine instead of blocking it; idle workers get heartbeats). "
        "Starting the ranks and loading their shards may take up to 600 s (or this, if longer).",
        section="Tensor parallelism",
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "tensor_parallel_size")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
