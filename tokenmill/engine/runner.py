"""ModelRunner: StepPlan -> flat batch tensors + KV view -> model -> logits of the rows that need them:
the sampled rows, then the prompt rows of ``prompt_logprobs`` (only in steps that have some).

The runner is the one place that picks a step's execution path: a pure decode step replays a CUDA
graph when one is available and fits, else runs the C++ decode forward when the backend and the
model both support it and it fits, else runs the model eagerly, as every other step does. The
paths compute the same logits. With tensor parallelism (``workers``) only the eager path runs (the
model has no C++ decode weights then, and the engine builds no graphs), inside the step sent to the
workers, which run the same forward on their shards.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from tokenmill.cache.manager import CacheManager
from tokenmill.cache.views import KVView
from tokenmill.distributed.step import step_inputs
from tokenmill.distributed.workers import WorkerGroup
from tokenmill.engine.cuda_graphs import CudaGraphDecodeRunner
from tokenmill.engine.scheduler import StepPlan
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.decode_forward import CpuDecodeForward


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_view: KVView
    logits_indices: torch.Tensor | None  # [n_sampled + n_prompt] rows of the flat batch that need logits; None: all


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheManager,
        device: torch.device,
        graphs: CudaGraphDecodeRunner | None = None,
        workers: WorkerGroup | None = None,
    ) -> None:
        if model.backend is None:
            raise ValueError("the model's attention backend must be set before building its runner")
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs = graphs  # CUDA-graph replay of pure decode steps (GPU only)
        self.workers = workers  # the other tensor-parallel ranks, which run every step's forward too
        kv_dtype = cache.storage.k_buffer.dtype
        self.cpu_decode = CpuDecodeForward.build(model, model.backend, kv_dtype)  # None where unsupported
        self.last_forward_time = 0.0  # seconds inside the model call of the last step (CPU: exact)

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Pack the plan's tokens in batch order (decode first, then prefill chunks)."""
        device = self.device
        if plan.is_pure_decode:
            view = self.cache.bind_decode([s.kv for s in plan.decode], plan.decode_slots)
            input_ids = torch.tensor([s.tokens(s.n_kv - 1, s.n_kv)[0] for s in plan.decode], device=device)
            positions = view.seq_lens - 1
            return ForwardBatch(input_ids, positions, view, None)  # every row samples

        seqs = plan.decode + [s for s, _ in plan.prefill]
        extend_lens = [1] * len(plan.decode) + [n for _, n in plan.prefill]
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        first_row: dict[int, int] = {}  # id(sequence) -> its first row in the flat batch
        for seq, n in zip(seqs, extend_lens):
            start = seq.n_kv - n
            first_row[id(seq)] = len(ids) - start
            ids.extend(seq.tokens(start, seq.n_kv))
            pos.extend(range(start, seq.n_kv))
            if seq.n_kv == seq.n_tokens:
                logits_rows.extend([len(ids) - 1] * (1 + len(plan.children(seq))))  # forked children share it
        for seq, positions in plan.prompt_logprobs:
            logits_rows.extend(first_row[id(seq)] + p for p in positions)
        parts = ([plan.decode_slots] if plan.decode else []) + plan.prefill_slots
        view = self.cache.bind_prefill([s.kv for s in seqs], extend_lens, torch.cat(parts))
        return ForwardBatch(
            torch.tensor(ids, device=device),
            torch.tensor(pos, device=device),
            view,
            torch.tensor(logits_rows, dtype=torch.int64, device=device),
        )

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[len(plan.sample_seqs) + n_prompt, vocab]``: ``plan.sample_seqs`` order, then the
        positions of ``plan.prompt_logprobs`` in order. Then copies the forked children's partial pages."""
        batch = self.prepare(plan)
        start = time.perf_counter()
        n_decode = len(plan.decode)
        fork_src = torch.cat([f.src_slots for f in plan.forks]) if plan.forks else None
        fork_dst = torch.cat([f.dst_slots for f in plan.forks]) if plan.forks else None
        with self._on_every_rank(batch, fork_src, fork_dst):
            if plan.is_pure_decode and self.graphs is not None and self.graphs.can_run(n_decode):
                logits = self.graphs.run(batch.input_ids, batch.positions, batch.kv_view)  # valid until next run
            elif plan.is_pure_decode and self.cpu_decode is not None and self.cpu_decode.can_run(n_decode):
                logits = self.cpu_decode(batch.input_ids, batch.positions, batch.kv_view)
            else:
                logits = self.model(batch.input_ids, batch.positions, batch.kv_view, batch.logits_indices)
            if fork_src is not None:
                self.cache.copy_kv(fork_src, fork_dst)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.last_forward_time = time.perf_counter() - start
        return logits

    def _on_every_rank(
        self, batch: ForwardBatch, fork_src: torch.Tensor | None, fork_dst: torch.Tensor | None
    ) -> contextlib.AbstractContextManager[None]:
        """With tensor parallelism, the step sent to the workers, whose forward runs with rank 0's inside."""
        if self.workers is None:
            return contextlib.nullcontext()
        no_forks = torch.empty(0, dtype=torch.int64, device=self.device)
        inputs = step_inputs(
            batch.input_ids,
            batch.positions,
            batch.kv_view,
            batch.logits_indices,
            no_forks if fork_src is None else fork_src,
            no_forks if fork_dst is None else fork_dst,
        )
        return self.workers.step(inputs)
