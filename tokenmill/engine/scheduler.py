"""Scheduler: decides each step's work under a token budget and the KV pages available.

Every step (engine thread only):
1. every running sequence that is decoding gets one token; when pages run out the most recently
   admitted sequence is preempted (its pages freed — full ones kept in the prefix cache — and it
   goes back to the head of the queue to be recomputed later; its generated tokens are kept);
2. running sequences part-way through their prompt get the next chunk (chunked prefill);
3. waiting sequences are admitted FIFO while rows, pages and the budget last.
Decode and prefill tokens of one step run in one ragged forward.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from tokenmill.cache.manager import CacheManager
from tokenmill.config import EngineConfig
from tokenmill.engine.sequence import SeqStatus, Sequence


@dataclass
class StepPlan:
    """One forward: decode sequences (one token each) then prefill chunks, in batch order."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]  # (sequence, tokens computed this step)
    decode_slots: torch.Tensor | None
    prefill_slots: list[torch.Tensor]

    @property
    def is_pure_decode(self) -> bool:
        return not self.prefill

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    @property
    def sample_seqs(self) -> list[Sequence]:
        """Sequences that get a next token from this step (prefill ones only on their last chunk)."""
        return self.decode + [s for s, _ in self.prefill if s.n_kv == s.n_tokens]

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode + [s for s, _ in self.prefill]


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    chunked_prefills: int = 0  # prefill steps that covered only part of a sequence's prompt
    prompt_tokens_computed: int = 0
    max_batch_tokens: int = 0
    mixed_steps: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._admissions = itertools.count()

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, cache_pages: bool) -> None:
        """Take ``seq`` out of the queues and release its KV (finish, abort or failure)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq.kv, seq.all_token_ids, cache_pages=cache_pages)

    def schedule(self) -> StepPlan | None:
        """The next step's plan, with KV slots already allocated; None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        decode = [s for s in self.running if not s.in_prefill]
        decode_slots = None
        while decode:
            decode_slots = self.cache.extend_decode([s.kv for s in decode])
            if decode_slots is not None:
                break
            victim = max(self.running, key=lambda s: s.admit_order)
            self._preempt(victim)
            if victim in decode:
                decode.remove(victim)
        budget -= len(decode)

        prefill: list[tuple[Sequence, int]] = []
        slots: list[torch.Tensor] = []
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            n = min(seq.n_tokens - seq.n_kv, budget)
            got = self.cache.extend(seq.kv, n)
            if got is None:  # out of pages: make room for later steps, never touch this plan's KV
                planned = set(map(id, decode)) | {id(s) for s, _ in prefill}
                self._preempt(max((s for s in self.running if id(s) not in planned), key=lambda s: s.admit_order))
                break
            prefill.append((seq, n))
            slots.append(got)
            budget -= n

        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.cache.req_pool.max_rows:
            seq = self.waiting.popleft()
            if seq.wait_for is not None and not (seq.wait_for.kv.prompt_cached or seq.wait_for.is_finished):
                skipped.append(seq)
                continue
            if not self.cache.alloc(seq.kv, seq.all_token_ids):
                self.waiting.appendleft(seq)
                break
            remaining = seq.n_tokens - seq.n_kv
            if self.cache.pages_needed(seq.kv, remaining) > self.cache.available_pages():
                self.cache.free(seq.kv, seq.all_token_ids, cache_pages=False)
                self.waiting.appendleft(seq)
                break
            n = min(remaining, budget)
            got = self.cache.extend(seq.kv, n)
            assert got is not None, "pages were checked available"
            seq.status = SeqStatus.RUNNING
            seq.admit_order = next(self._admissions)
            self.running.append(seq)
            prefill.append((seq, n))
            slots.append(got)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        if not decode and not prefill:
            return None
        plan = StepPlan(decode=decode, prefill=prefill, decode_slots=decode_slots, prefill_slots=slots)
        self._count(plan)
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.kv, seq.all_token_ids, cache_pages=True)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _count(self, plan: StepPlan) -> None:
        stats = self.stats
        stats.steps += 1
        stats.max_batch_tokens = max(stats.max_batch_tokens, plan.n_tokens)
        stats.mixed_steps += bool(plan.decode and plan.prefill)
        for seq, n in plan.prefill:
            stats.prompt_tokens_computed += n
            stats.chunked_prefills += seq.n_kv < seq.n_tokens
