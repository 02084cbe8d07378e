"""Executor: one way to reach every rank's ``ModelWorker``, for any number of ranks.

:meth:`Executor.execute` runs a step's forward on every rank (rank 0's worker here; with tensor
parallelism the step is broadcast first and rank 0's forward runs inside the broadcast's hold on the
group); :meth:`Executor.call` runs the same ``ModelWorker`` method with the same arguments on every
rank between steps (weight updates, LoRA slot loads) and returns each rank's result. With one rank
both are local calls. Whether a rank replays a CUDA graph or runs the C++ decode forward is its
worker's decision, not the executor's.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.config import EngineConfig, Resolved
from tokenmill.distributed.worker_group import WorkerGroup, WorkerGroupError, start_worker_group
from tokenmill.distributed.worker_process import RankError
from tokenmill.model.parallel import SINGLE
from tokenmill.worker.forward_step import ForwardStep
from tokenmill.worker.model_worker import ModelWorker, build_model_worker


class Executor:
    """Rank 0's model worker and, with ``tensor_parallel_size > 1``, the group of the others."""

    def __init__(self, worker: ModelWorker, group: WorkerGroup | None = None) -> None:
        self.worker = worker
        self.group = group

    @classmethod
    def start(cls, config: EngineConfig, resolved: Resolved, table: torch.Tensor) -> Executor:
        """Start the other ranks (if any) and build every rank's worker; rank 0's uses ``table``
        (the cache manager's request-to-token table), the others keep replicas of it."""
        group = start_worker_group(config, resolved)  # None at tensor_parallel_size 1
        try:
            tp = group.tp if group is not None else SINGLE
            agree = group.agree_on_slots if group is not None else None
            return cls(build_model_worker(config, resolved, tp, table, agree), group)
        except BaseException:
            if group is not None:
                group.shutdown()
            raise

    @property
    def ranks(self) -> int:
        return 1 if self.group is None else self.group.tp.size

    def execute(self, step: ForwardStep) -> torch.Tensor:
        """Rank 0's logits of ``step`` (see ``ModelWorker.execute``) after every rank ran it."""
        if self.group is None:
            return self.worker.execute(step)
        with self.group.step(step):
            return self.worker.execute(step)

    def call(self, method: str, *args: Any) -> list[Any]:
        """``ModelWorker.<method>(*args)`` on every rank, between steps: each rank's result by rank.
        Rank 0's error is raised as it is; a worker's as a RuntimeError naming its rank. With several
        ranks either fails the group (the engine turns unhealthy): the ranks may now differ."""
        results = [getattr(self.worker, method)(*args)] if self.group is None else self._call_group(method, args)
        errors = [r for r in results if isinstance(r, RankError)]
        if errors:
            raise RuntimeError("; ".join(f"tensor-parallel rank {e.rank}: {method} failed: {e.error}" for e in errors))
        return results

    def _call_group(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        assert self.group is not None
        return self.group.call(method, args, lambda: getattr(self.worker, method)(*args))

    def failure(self) -> BaseException | None:
        """The other ranks' failure, if they failed (the engine cannot run steps any more)."""
        failure = self.group.failure if self.group is not None else None
        return None if failure is None else WorkerGroupError(failure)

    def shutdown(self) -> None:
        """Stop the other ranks (nothing at one rank)."""
        if self.group is not None:
            self.group.shutdown()
