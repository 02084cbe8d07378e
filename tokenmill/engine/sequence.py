"""Sequence: one completion being generated (a request with ``n > 1`` owns ``n`` of them), or a
pooling request's prompt (``pooling`` set: computed like a prompt's prefill, never sampled).

The scheduler, runner, sampler and output stage work on sequences; only the engine thread touches
them. ``kv`` is the sequence's handle on the KV cache: the CacheManager writes it, everyone else
only reads it.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenmill.cache.handle import KVHandle
from tokenmill.engine.grammar import SequenceGrammar
from tokenmill.request import Logprob, PoolingParams, RequestMetrics, SamplingParams

_seq_ids = itertools.count()


class RequestGroup(Protocol):
    """The request a sequence belongs to, as its ``group``: the engine's
    :class:`~tokenmill.engine.request_state.RequestState`, which holds its sequences (that module
    imports this one, so this one names the request by what its readers use of it, not by import)."""

    request_id: str
    call_id: str  # the call it came in: admission shares by call
    token_limit: int  # prompt + max_tokens, as validated: no sequence grows past it
    metrics: RequestMetrics
    seqs: list[Sequence]  # its n sequences, this one among them


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0
    group: RequestGroup | None = None  # the request this sequence belongs to (set by intake)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    lora_versions: list[int] = field(default_factory=list)  # its adapter's version per output token (with one)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    wait_for: Sequence | None = None  # a sibling: forked from this one once its prompt is computed (n > 1)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # sequence 0 only, when asked: see below
    generator: torch.Generator | None = None  # per-request seed; None = the engine's generator
    grammar: SequenceGrammar | None = None  # structured output: its matcher (released when the sequence ends)
    pooling: PoolingParams | None = None  # a pooling request (defaults resolved): an embedding or a score
    pooled: torch.Tensor | None = (
        None  # fp32: the hidden-state sum ("mean") or row gathered so far; a score's logits row
    )
    embedding: list[float] | None = None  # set when its prompt is complete
    score: float | None = None  # a scoring request's, set when its prompt is complete
    token_type_ids: list[int] | None = None  # an encoder's segment of each prompt token (None: all 0)
    whole_prompt: bool = False  # an encoder's input: computed in one step, never from the prefix cache
    lora_name: str | None = None  # the LoRA adapter it is generated with (None: the base model)
    lora_slot: int = -1  # the adapter's slot while the sequence runs (written by the scheduler), else -1

    kv: KVHandle = field(default_factory=KVHandle)
    admit_order: int = -1  # written by the scheduler at each admission
    stop_token_ids: frozenset[int] = field(init=False)  # params.stop_token_ids as a set, built once

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.params.stop_token_ids or ())
        if self.index == 0 and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Positions of ``start .. end-1`` whose logits give a prompt logprob not yet collected:
        position ``p`` gives the entry of prompt token ``p + 1`` (``prompt_logprobs[p + 1]``)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, len(self.prompt_token_ids) - 1))

    def pooling_positions(self, start: int, end: int) -> range:
        """Positions of ``start .. end-1`` whose final hidden states (a score: logits) the pooling
        needs: all of them for "mean", the first for "cls", the last prompt position for "last",
        none without pooling."""
        if self.pooling is None:
            return range(0)
        if self.pooling.pooling == "mean":
            return range(start, end)
        at = 0 if self.pooling.pooling == "cls" else len(self.prompt_token_ids) - 1
        return range(at, at + 1) if start <= at < end else range(0)

    @property
    def needs_every_position(self) -> bool:
        """Every prompt token must be computed here (no prefix-cache match): prompt logprobs, mean or
        CLS pooling, an encoder's input."""
        pooled_early = self.pooling is not None and self.pooling.pooling in ("mean", "cls")
        return self.needs_prompt_logits or pooled_early or self.whole_prompt

    @property
    def needs_prompt_logits(self) -> bool:
        """Some prompt logprob is still to be collected (so no prompt token may come from the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole history."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def last_token(self) -> int:
        """The newest token (the one a decode step feeds), without concatenating the history."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def row(self) -> int | None:
        """The sequence's request-to-token row while it holds KV."""
        return self.kv.row

    @property
    def n_kv(self) -> int:
        """Positions ``0 .. n_kv-1`` have KV in the cache."""
        return self.kv.n_kv

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while some known tokens still lack KV beyond the one being decoded (a pooling
        sequence decodes nothing: until its whole prompt has KV)."""
        return self.n_kv < self.n_tokens - (self.pooling is None)
