"""Speculative decoding's plan side: proposals before the step (``engine/verifier.py`` verifies them after it).

Before a step, :meth:`Speculator.proposals` asks the proposer for up to k tokens per decoding
sequence (none while more sequences decode than ``disable_by_batch_size``); the scheduler gives a
sequence with a proposal ``1 + k`` slots, and the step computes the sequence's last token and the k
proposed ones (a :class:`Verification`) as ``1 + k`` one-token requests on its row, in the same
forward as the other sequences, with logits at every one of them (``engine/forward_inputs.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.spec_draft import DraftModelProposer
from tokenmill.engine.spec_ngram import NgramProposer
from tokenmill.speculative_config import SpeculativeConfig
from tokenmill.tokenizer import Tokenizer

MAX_BACKOFF_STEPS = 64
"""Most decode steps a sequence goes without proposals after proposals that were all rejected."""
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 2, "draft_model": 1}
"""Most decoding sequences in a step for which the engine speculates, by method, when the setting
names no ``disable_by_batch_size``: the crossover measurements in docs/benchmarks.md (prompt lookup still pays
with two sequences at a time and not with four; a draft model already loses with two)."""


class Proposer(Protocol):
    """Guesses the tokens that follow a sequence (a new proposer is a new file with this method)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``seq``'s tokens; empty for no guess."""
        ...

    def retain(self, seq_ids: set[int]) -> None:
        """Forget what is kept for sequences other than ``seq_ids`` (the ones decoding now)."""
        ...


@dataclass
class Verification:
    """A decoding sequence whose step computes its last token and ``proposal`` (``slots``: the
    ``1 + len(proposal)`` KV slots, in position order)."""

    seq: Sequence
    proposal: list[int]
    slots: torch.Tensor


@dataclass
class SpeculationStats:
    """What speculation did since the engine started (``Engine.stats()["speculative"]``)."""

    method: str
    verify_steps: int = 0  # steps that verified at least one proposal
    proposed_tokens: int = 0
    accepted_tokens: int = 0  # proposed tokens that were emitted
    propose_seconds: float = 0.0  # wall time spent proposing (a draft model's forwards included)


@dataclass
class _Backoff:
    """A sequence's run of wholly rejected proposals and the steps it still goes without one."""

    misses: int = 0
    skip: int = 0


@dataclass
class Speculator:
    """One engine's proposer, its setting and the counters ``engine/verifier.py`` updates (engine
    thread only).

    Back-off: a sequence whose proposal was wholly rejected goes the next ``2 ** misses`` steps
    without one (``misses`` such proposals in a row, at most :data:`MAX_BACKOFF_STEPS` steps), so a
    proposer that does not match the text (a poor draft model, prompt lookup in prose) costs little
    beyond an occasional probe; one accepted token ends the back-off.
    """

    config: SpeculativeConfig
    proposer: Proposer
    stats: SpeculationStats
    backoff: dict[int, _Backoff] = field(default_factory=dict)  # seq_id -> its back-off

    @classmethod
    def build(
        cls,
        config: SpeculativeConfig,
        engine: EngineConfig,
        context_limit: int,
        kv_tokens: int,
        vocab_size: int,
        tokenizer: Tokenizer | None,
        device: torch.device,
    ) -> Speculator:
        """The speculator of an engine whose sequences hold up to ``context_limit`` tokens each and
        ``kv_tokens`` in all, of a ``vocab_size``-token model (a draft model is loaded and checked
        against it here)."""
        proposer: Proposer
        if config.model is not None:
            rows = min(
                config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE[config.method],
                engine.max_running_requests,
            )
            proposer = DraftModelProposer.build(
                engine, config.model, rows, context_limit, kv_tokens, vocab_size, tokenizer, device
            )
        else:
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        return cls(config, proposer, SpeculationStats(config.method))

    @property
    def max_batch(self) -> int:
        return self.config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE[self.config.method]

    def proposals(self, decode: list[Sequence], budget: int) -> dict[int, list[int]]:
        """``id(seq) -> proposal`` for the decoding sequences that get one: none above
        :attr:`max_batch` sequences, none for a sequence in back-off; each at most k tokens, fewer
        than the tokens its limit leaves (the last emitted token is never a proposal's), cut at the
        first token a structured-output sequence's grammar refuses, all together at most ``budget``."""
        if len(decode) > self.max_batch:
            self.proposer.retain(set())
            self.backoff.clear()
            return {}
        started = time.perf_counter()
        decoding = {seq.seq_id for seq in decode}
        self.proposer.retain(decoding)
        self.backoff = {seq_id: b for seq_id, b in self.backoff.items() if seq_id in decoding}
        proposals = {}
        for seq in decode:
            backoff = self.backoff.get(seq.seq_id)
            if backoff is not None and backoff.skip > 0:
                backoff.skip -= 1
                continue
            assert seq.group is not None
            room = min(self.config.num_speculative_tokens, seq.group.token_limit - seq.n_tokens - 1, budget)
            proposal = self.proposer.propose(seq, room) if room > 0 else []
            if proposal and seq.grammar is not None:  # cut at the first token the grammar refuses
                proposal = proposal[: seq.grammar.accepted_prefix(proposal)]
            if proposal:
                proposals[id(seq)] = proposal
                budget -= len(proposal)
        self.stats.propose_seconds += time.perf_counter() - started
        return proposals

    def record(self, seq: Sequence, accepted: int) -> None:
        """How many tokens of ``seq``'s proposal this step were accepted (the back-off's evidence)."""
        if accepted:
            self.backoff.pop(seq.seq_id, None)
            return
        backoff = self.backoff.setdefault(seq.seq_id, _Backoff())
        backoff.misses += 1
        backoff.skip = min(2**backoff.misses, MAX_BACKOFF_STEPS)
