"""StepCore: one engine step in one direction: schedule -> execute -> sample -> update.

1. **schedule**: the scheduler allocates, extends, forks and frees KV and returns the step's plan;
   the tier's queued blocks move (once a step, before the forward reads or overwrites them).
2. **execute**: the plan as plain data (``engine/forward_inputs.py``) runs on every rank
   (``distributed/executor.py``); the logits are taken apart (``engine/logit_rows.py``).
3. **sample** (``engine/sampler.py``), isolating a failing sequence.
4. **update** (the output stage, ``engine/output.py``): tokens are appended, stop rules applied,
   deltas emitted; verifications are accepted or cut back (``engine/verifier.py``). The prompts the
   forward computed went into the prefix cache already, right after it (``cache_prompts``, before
   their first token is appended).

A failure inside a step fails that step's sequences (a sampling failure only its own) and the loop
goes on. Engine thread only; the step core knows nothing of ranks.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import torch

from tokenmill.cache.manager import CacheManager
from tokenmill.cache.tier_mover import move_tier_blocks
from tokenmill.distributed.executor import Executor
from tokenmill.engine.forward_inputs import forward_step
from tokenmill.engine.logit_rows import split_logits
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.request_table import RequestTable
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler, StepPlan
from tokenmill.engine.speculation import Speculator
from tokenmill.engine.thread_governor import ThreadGovernor
from tokenmill.engine.verifier import verify
from tokenmill.request import now

logger = logging.getLogger("tokenmill.engine")


@dataclass
class StepCore:
    """The parts a step uses, and the step."""

    executor: Executor
    cache: CacheManager
    scheduler: Scheduler
    sampler: Sampler
    output: OutputProcessor
    requests: RequestTable
    speculator: Speculator | None
    threads: ThreadGovernor | None
    eos_token_ids: set[int]
    step_time: float = 0.0  # wall seconds in steps that ran a forward
    forward_time: float = 0.0  # of which inside the model forward

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def move_tier_blocks(self) -> None:
        """Exchange the blocks the cache queued with its host / disk tier (nothing without one)."""
        move_tier_blocks(self.cache, self.executor.worker.storage)

    def step(self) -> bool:
        """Run one step; False when nothing was runnable yet (the caller waits for a command)."""
        if self.threads is not None:
            self.threads.tick()
        plan = self.scheduler.schedule()
        if plan is None:
            return False
        started = now()
        self.requests.mark_scheduled(plan.seqs, started)
        output = self.output
        try:
            self.move_tier_blocks()
            worker = self.executor.worker
            logits = self.executor.execute(forward_step(plan, self.cache.req_pool, worker.device))
            if plan.prefill and not plan.decode and not plan.verify:
                self.cache.observe_prefill(sum(n for _, n in plan.prefill), worker.last_forward_time)
            output.cache_prompts(plan.sample_seqs[len(plan.decode) :])
            logits, verify_logits = split_logits(plan, logits, worker.last_hidden)
            sampled, result, failures = self.sampler.sample_isolating_failures(
                logits, plan.sample_seqs, self.eos_token_ids
            )
        except Exception as exc:
            logger.error("step failed; failing its %d sequence(s):\n%s", len(plan.seqs), traceback.format_exc())
            output.fail(plan.seqs, f"internal error in engine step: {type(exc).__name__}: {exc}")
            return True
        for seq, exc in failures:  # only these sequences (and their siblings) fail; the others go on
            logger.error("sampling failed for sequence %d: %s: %s", seq.seq_id, type(exc).__name__, exc)
            output.fail([seq], f"internal error in sampling: {type(exc).__name__}: {exc}")
        output.process(sampled, result.token_ids, result.logprobs)
        output.finish_pooled(plan.pooled_seqs)
        if plan.verify:
            self._verify(plan, verify_logits)
        self.step_time += now() - started
        self.forward_time += self.executor.worker.last_forward_time
        return True

    def _verify(self, plan: StepPlan, verify_logits: torch.Tensor) -> None:
        assert self.speculator is not None
        try:
            verify(
                plan.verify, verify_logits, self.sampler, self.output, self.cache, self.eos_token_ids, self.speculator
            )
        except Exception as exc:
            logger.error("verification failed:\n%s", traceback.format_exc())
            self.output.fail(
                [v.seq for v in plan.verify], f"internal error in verification: {type(exc).__name__}: {exc}"
            )
