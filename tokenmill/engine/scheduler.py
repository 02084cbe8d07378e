"""Scheduler: decides each step's work under a token budget and the KV pages available.

Every step (engine thread only):
1. every running sequence that is decoding gets one token; when pages run out the most recently
   admitted sequence is preempted (its pages freed — full ones kept in the prefix cache — and it
   goes back to the head of the queue to be recomputed later; its generated tokens are kept);
2. running sequences part-way through their prompt get the next chunk (chunked prefill);
3. waiting sequences are admitted while rows, pages and the budget last: preempted ones first, then
   call by call (the call with the fewest running sequences next; first come, first served within
   a call and between equal calls), so one call of many prompts cannot hold the queue;
4. the siblings of an ``n > 1`` request wait until sequence 0's prompt is computed: in the step
   that computes its last prompt token, each sibling is forked from it (the full pages shared, the
   partial last page copied after the forward) and samples its first token from the same logits,
   so the prompt runs once and every sibling starts decoding in the same step. A sibling that finds
   no row or page then is admitted as a sequence of its own once sequence 0 has its first token.
With speculative decoding (``engine/speculation.py``), after step 1 a decoding sequence with a
proposal gets ``k`` more slots (never at the cost of a preemption: without pages it decodes plainly)
and becomes a :class:`Verification`. Decode, verification and prefill tokens of one step run in one
ragged forward. A sequence asking
``prompt_logprobs`` is admitted without a prefix-cache match, so every prompt token has logits.
A sequence with a LoRA adapter (``Sequence.lora_name``) is admitted only while its adapter has, or
can get, one of the model's adapter slots (``engine/lora_manager.py``; else it waits and later
sequences may go first); it holds the slot while it runs, and its prefixes are cached in its
adapter version's namespace.
A pooling sequence (``Sequence.pooling``) is scheduled exactly as a prompt's prefill and never
sampled; the plan names the positions whose hidden states it needs (mean pooling: every one, so it
too is admitted without a prefix-cache match), and it ends in the step that completes its prompt.
An encoder's input (``Sequence.whole_prompt``) is admitted only into a step with budget for all of
it, without a prefix-cache match: bidirectional attention needs every token in one forward.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import torch

from tokenmill.cache.manager import CacheManager
from tokenmill.config.scheduler import SchedulerOptions
from tokenmill.engine.lora_manager import LoRAManager
from tokenmill.engine.sequence import SeqStatus, Sequence
from tokenmill.engine.speculation import Speculator, Verification


@dataclass
class Fork:
    """``child`` got ``parent``'s prompt KV this step; after the forward, the K/V of ``src_slots``
    (the parent's partial last page) is copied to ``dst_slots`` (the child's own page)."""

    parent: Sequence
    child: Sequence
    src_slots: torch.Tensor
    dst_slots: torch.Tensor


@dataclass
class StepPlan:
    """One forward: decode sequences (one token each), verifications (``1 + k`` tokens each), then
    prefill chunks, in batch order."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]  # (sequence, tokens computed this step)
    decode_slots: torch.Tensor | None
    prefill_slots: list[torch.Tensor]
    forks: list[Fork] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, range]] = field(default_factory=list)
    """Prefill positions whose logits give prompt logprobs (``Sequence.prompt_logprob_positions``)."""
    pooling: list[tuple[Sequence, range]] = field(default_factory=list)
    """Prefill positions whose final hidden states pooling sequences need (``Sequence.pooling_positions``)."""
    verify: list[Verification] = field(default_factory=list)

    @property
    def is_pure_decode(self) -> bool:
        """No prefill chunk: every token of the step is a one-token request (verifications included)."""
        return not self.prefill

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(1 + len(v.proposal) for v in self.verify) + sum(n for _, n in self.prefill)

    @cached_property
    def sample_seqs(self) -> list[Sequence]:
        """Sequences that get a next token from this step (prefill ones only on their last chunk),
        each forked child right after its parent (it samples from the parent's logits); computed once,
        on first use, which comes before any of them gets its token."""
        seqs = list(self.decode)
        for seq, _ in self.prefill:
            if seq.n_kv == seq.n_tokens and seq.pooling is None:
                seqs.append(seq)
                seqs.extend(self.children(seq))
        return seqs

    @property
    def pooled_seqs(self) -> list[Sequence]:
        """Pooling sequences whose prompt this step completes."""
        return [seq for seq, _ in self.prefill if seq.pooling is not None and seq.n_kv == seq.n_tokens]

    def children(self, seq: Sequence) -> list[Sequence]:
        """Sequences forked from ``seq`` this step."""
        return [f.child for f in self.forks if f.parent is seq]

    @property
    def seqs(self) -> list[Sequence]:
        verified = [v.seq for v in self.verify]
        return self.decode + verified + [s for s, _ in self.prefill] + [f.child for f in self.forks]


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    chunked_prefills: int = 0  # prefill steps that covered only part of a sequence's prompt
    prompt_tokens_computed: int = 0
    max_batch_tokens: int = 0
    mixed_steps: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerOptions,
        cache: CacheManager,
        speculator: Speculator | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.speculator = speculator
        self.lora = lora
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
        self._release_lora(seq)
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
        verify: list[Verification] = []
        if self.speculator is not None and decode_slots is not None:
            decode, decode_slots, verify = self._speculate(self.speculator, decode, decode_slots, budget)
            budget -= sum(len(v.proposal) for v in verify)

        prefill: list[tuple[Sequence, int]] = []
        slots: list[torch.Tensor] = []
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            n = min(seq.n_tokens - seq.n_kv, budget)
            got = self.cache.extend(seq.kv, n)
            if got is None:  # out of pages: make room for later steps, never touch this plan's KV
                planned = {id(s) for s in decode + [v.seq for v in verify]} | {id(s) for s, _ in prefill}
                self._preempt(max((s for s in self.running if id(s) not in planned), key=lambda s: s.admit_order))
                break
            prefill.append((seq, n))
            slots.append(got)
            budget -= n

        admitted: set[int] = set()
        has_room = budget > 0 and len(self.running) < self.cache.req_pool.max_rows
        for seq in self._admission_order() if has_room else ():
            if budget <= 0 or len(self.running) >= self.cache.req_pool.max_rows:
                break
            parent = seq.wait_for
            if parent is not None and not (parent.output_token_ids or parent.is_finished):
                continue  # forked once the parent's prompt is computed
            if seq.whole_prompt and seq.n_tokens > budget:
                continue  # an encoder's input runs in one step: it waits for a step with room for all of it
            namespace = self._acquire_lora(seq)
            if namespace is None:
                continue  # every adapter slot is in use by running sequences of other adapters
            if not self.cache.alloc(seq.kv, seq.all_token_ids, not seq.needs_every_position, namespace):
                self._release_lora(seq)
                break
            remaining = seq.n_tokens - seq.n_kv
            if self.cache.pages_needed(seq.kv, remaining) > self.cache.available_pages():
                self.cache.free(seq.kv, seq.all_token_ids, cache_pages=False)
                self._release_lora(seq)
                break
            n = min(remaining, budget)
            got = self.cache.extend(seq.kv, n)
            assert got is not None, "pages were checked available"
            seq.status = SeqStatus.RUNNING
            seq.admit_order = next(self._admissions)
            self.running.append(seq)
            admitted.add(id(seq))
            prefill.append((seq, n))
            slots.append(got)
            budget -= n
        if admitted:
            self.waiting = deque(s for s in self.waiting if id(s) not in admitted)

        if not decode and not verify and not prefill:
            return None
        plan = StepPlan(decode, prefill, decode_slots if decode else None, slots, verify=verify)
        for seq, n in prefill:
            if seq.n_kv == seq.n_tokens and not seq.output_token_ids and seq.params.n > 1:
                plan.forks += self._fork_siblings(seq)
            positions = seq.prompt_logprob_positions(seq.n_kv - n, seq.n_kv)
            if positions:
                plan.prompt_logprobs.append((seq, positions))
            pooled = seq.pooling_positions(seq.n_kv - n, seq.n_kv)
            if pooled:
                plan.pooling.append((seq, pooled))
        self._count(plan)
        return plan

    def _admission_order(self) -> Iterator[Sequence]:
        """The waiting sequences in the order admission tries them: those admitted before (preempted)
        first, in queue order; then call by call (``RequestState.call_id``), the call with the fewest
        running sequences first (ties: the call whose first waiting sequence came first), each call's
        sequences in arrival order, a sequence counting as running once tried. So a call of thousands
        of prompts takes its share of the rows that free up, not all of them."""
        fresh: dict[str, deque[Sequence]] = {}
        waiting = list(self.waiting)
        for seq in waiting:
            if seq.admit_order >= 0:
                yield seq
            else:
                fresh.setdefault(_call(seq), deque()).append(seq)
        running = Counter(_call(s) for s in self.running)
        calls = [(running[call], arrival, call) for arrival, call in enumerate(fresh)]
        heapq.heapify(calls)
        while calls:
            count, arrival, call = heapq.heappop(calls)
            queue = fresh[call]
            yield queue.popleft()
            if queue:
                heapq.heappush(calls, (count + 1, arrival, call))

    def _speculate(
        self, speculator: Speculator, decode: list[Sequence], decode_slots: torch.Tensor, budget: int
    ) -> tuple[list[Sequence], torch.Tensor, list[Verification]]:
        """Split the decoding sequences (each holding its decode slot) into those that decode plainly
        and those whose proposal got its further slots; returns the first with their slots, then the
        verifications."""
        proposals = speculator.proposals(decode, budget)
        plain, kept, verify = [], [], []
        for i, seq in enumerate(decode):
            proposal = proposals.get(id(seq))
            more = self.cache.extend(seq.kv, len(proposal)) if proposal else None
            if more is None:  # no proposal, or no pages for it: a plain decode
                plain.append(seq)
                kept.append(i)
                continue
            verify.append(Verification(seq, proposal, torch.cat([decode_slots[i : i + 1], more])))
        return plain, decode_slots[kept], verify

    def _fork_siblings(self, parent: Sequence) -> list[Fork]:
        """Fork the waiting siblings of ``parent``, whose prompt this step completes, while rows and
        pages last; they run from now on."""
        forks = []
        for child in [s for s in self.waiting if s.wait_for is parent]:
            slots = self.cache.fork(parent.kv, child.kv)
            if slots is None:
                break
            self.waiting.remove(child)
            namespace = self._acquire_lora(child)  # the parent holds the adapter's slot: never None
            assert namespace is not None
            child.status = SeqStatus.RUNNING
            child.admit_order = next(self._admissions)
            self.running.append(child)
            forks.append(Fork(parent, child, *slots))
        return forks

    def _acquire_lora(self, seq: Sequence) -> str | None:
        """Give ``seq`` its adapter's slot (``seq.lora_slot``); returns its prefix-cache namespace
        (``""`` without an adapter), None when no slot can be had now."""
        if seq.lora_name is None:
            return ""
        assert self.lora is not None, "a sequence with an adapter needs the engine's LoRA manager"
        slot = self.lora.acquire(seq.lora_name)
        if slot is None:
            return None
        seq.lora_slot = slot
        return self.lora.namespace(seq.lora_name)

    def _release_lora(self, seq: Sequence) -> None:
        """``seq`` stopped running (or was not admitted): its hold on its adapter's slot ends."""
        if seq.lora_slot >= 0 and self.lora is not None and seq.lora_name is not None:
            self.lora.release(seq.lora_name)
        seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_lora(seq)
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


def _call(seq: Sequence) -> str:
    """The call ``seq`` came in (its request's ``call_id``; one shared call for a sequence without a request)."""
    return seq.group.call_id if seq.group is not None else ""
