"""Batched next-token sampling with vLLM semantics.

Per step, for each sequence (one row of ``logits``), in this order:

1. ``logit_bias`` is added; while ``min_tokens`` is unmet, EOS ids (unless ``ignore_eos``) and
   ``stop_token_ids`` are set to ``-inf``.
2. Repetition / frequency / presence penalties (:func:`apply_penalties`), using per-row token
   counts that the sampler maintains incrementally across steps.
3. ``temperature == 0``: exact argmax. Otherwise: divide by the temperature, drop tokens under
   ``min_p * max prob``, keep the ``top_k`` largest, keep the ``top_p`` nucleus (computed on the
   distribution left after min-p and top-k; these filters and the penalties are in
   ``engine/logits_processors.py``), then draw by inverse CDF (one uniform number per
   sequence against the running sum of its probabilities), from the sequence's own generator if
   it has one.

Logprobs (``engine/logprobs.py``) come from ``log_softmax`` of the raw model logits, before any of the above.

A sequence with a grammar (structured output) first has every token its grammar does not allow
set to ``-inf``, in every sampling mode; its logprobs then come from these masked logits (the
distribution it samples from, before the transforms above). Rows without a grammar pay nothing.
A grammar sequence left with no allowed token once every mask is applied (a dead end of its
grammar, or its only tokens banned by ``min_tokens`` / ``logit_bias``) gets :data:`NO_ALLOWED_TOKEN`
instead of a token (and no logprobs): the output stage ends it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.grammar import apply_grammar_masks
from tokenmill.engine.logits_processors import _filter_logits, apply_penalties
from tokenmill.engine.logprobs import sampled_logprobs
from tokenmill.engine.sequence import Sequence
from tokenmill.kernels.first_maxima import first_maxima
from tokenmill.request import Logprob

NO_ALLOWED_TOKEN = -1
"""The "token" of a grammar sequence that no token may follow (see the module docstring)."""


@dataclass
class SampleResult:
    """``token_ids[i]`` and ``logprobs[i]`` belong to ``seqs[i]``; ``logprobs[i]`` is None unless
    that sequence asked for logprobs."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    """Chooses the next token of each sequence in a batch (see the module docstring).

    ``sample`` never modifies the caller's ``logits``: the general path works on an fp32 copy and
    the all-greedy fast path only reads them.

    Penalty state: ``output_counts`` (int32) and ``prompt_mask`` (bool), both ``[max_rows, V]``,
    allocated on the first penalized sequence. Row ``r`` describes the sequence whose ``seq_id``
    owns it and the first ``n`` of its output tokens. A penalized sequence whose row is owned by
    another sequence (recycled row, preempted sequence back in a new row) or whose output length
    differs from what was counted gets its row rebuilt from its prompt and output; after sampling,
    the chosen token is counted, on the assumption that the caller appends it to
    ``output_token_ids`` before the next ``sample`` (otherwise the row is rebuilt then).
    """

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self._owner: list[int | None] = [None] * max_rows
        self._n_counted: list[int] = [0] * max_rows

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> SampleResult:
        """Pick one token per sequence from ``logits`` ``[len(seqs), V]`` (any float dtype).

        Penalized sequences must have ``row`` set. Draws for a sequence with ``generator`` use only
        that generator; other random sequences share the sampler's generator.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [{len(seqs)}, {self.vocab_size}], got {list(logits.shape)}")
        grammar_rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if grammar_rows:  # from here on, "the model's logits" are the masked ones (a copy)
            logits = logits.to(dtype=torch.float32, copy=True)
            apply_grammar_masks(logits, grammar_rows, [seqs[i].grammar for i in grammar_rows])
        banned = [_banned_ids(seq, eos_token_ids) for seq in seqs]
        penalized = [seq for seq in seqs if seq.params.uses_penalties]
        wants_logprobs = any(seq.params.logprobs is not None for seq in seqs)
        if all(map(_plain_greedy, seqs)) and not any(banned):
            token_ids = first_maxima(logits)  # the first maximal entry, as argmax
            picked = [token_ids[i] for i in grammar_rows]
            dead = logits[grammar_rows, picked] == float("-inf") if grammar_rows else None
            _mark_dead_ends(token_ids, grammar_rows, dead, [None] * len(seqs))
            return SampleResult(token_ids, [None] * len(seqs))

        work = logits.to(dtype=torch.float32, copy=True)
        self._apply_bias_and_bans(work, seqs, banned)
        if penalized:
            self._apply_penalties(work, seqs)
        tokens = work.argmax(dim=-1)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=work.device)
            tokens[index] = self._sample_random(work[index], [seqs[i] for i in random_rows])
        token_ids = tokens.tolist()
        if penalized:
            self._count_chosen(seqs, token_ids)
        logprobs = sampled_logprobs(logits, seqs, token_ids) if wants_logprobs else [None] * len(seqs)
        if grammar_rows:  # a dead end's count and logprobs are dropped with it
            dead = ~torch.isfinite(work[grammar_rows]).any(dim=-1)
            _mark_dead_ends(token_ids, grammar_rows, dead, logprobs)
        return SampleResult(token_ids, logprobs)

    def sample_isolating_failures(
        self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]
    ) -> tuple[list[Sequence], SampleResult, list[tuple[Sequence, Exception]]]:
        """:meth:`sample`, where one sequence's failure does not fail the others.

        Returns the sequences that got a token, their result, and each failed sequence with its
        error. If the batch raises, every sequence is sampled alone, its own generator first rewound
        to where the batch found it (so it draws what it would have drawn in a clean batch), and
        only the sequences that fail alone fail.
        """
        generators = [(g, g.get_state()) for seq in seqs if (g := seq.generator) is not None]
        try:
            return seqs, self.sample(logits, seqs, eos_token_ids), []
        except Exception:
            for generator, state in generators:
                generator.set_state(state)
        sampled: list[Sequence] = []
        result = SampleResult([], [])
        failures: list[tuple[Sequence, Exception]] = []
        for i, seq in enumerate(seqs):
            try:
                alone = self.sample(logits[i : i + 1], [seq], eos_token_ids)
            except Exception as exc:
                failures.append((seq, exc))
                continue
            sampled.append(seq)
            result.token_ids += alone.token_ids
            result.logprobs += alone.logprobs
        return sampled, result, failures

    def _apply_bias_and_bans(self, work: torch.Tensor, seqs: list[Sequence], banned: list[set[int]]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, seq in enumerate(seqs):
            for token, bias in (seq.params.logit_bias or {}).items():
                rows.append(i)
                cols.append(token)
                values.append(float(bias))
        if rows:
            index = (torch.tensor(rows, device=work.device), torch.tensor(cols, device=work.device))
            work.index_put_(index, torch.tensor(values, device=work.device), accumulate=True)
        ban_rows = [i for i, ids in enumerate(banned) for _ in ids]
        if ban_rows:
            ban_cols = [token for ids in banned for token in ids]
            index = (torch.tensor(ban_rows, device=work.device), torch.tensor(ban_cols, device=work.device))
            work.index_put_(index, torch.tensor(float("-inf"), device=work.device))

    def _apply_penalties(self, work: torch.Tensor, seqs: list[Sequence]) -> None:
        batch_rows = [i for i, seq in enumerate(seqs) if seq.params.uses_penalties]
        penalized = [seqs[i] for i in batch_rows]
        state_rows = torch.tensor(self._sync_rows(penalized), device=self.device)
        assert self.output_counts is not None and self.prompt_mask is not None
        index = torch.tensor(batch_rows, device=work.device)
        work[index] = apply_penalties(
            work[index],
            self.prompt_mask[state_rows].to(work.device),
            self.output_counts[state_rows].to(work.device),
            torch.tensor([s.params.repetition_penalty for s in penalized], device=work.device),
            torch.tensor([s.params.frequency_penalty for s in penalized], device=work.device),
            torch.tensor([s.params.presence_penalty for s in penalized], device=work.device),
        )

    def _sync_rows(self, seqs: list[Sequence]) -> list[int]:
        """Make each sequence's state row describe it (rebuilding stale rows); return the rows."""
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        rows = []
        for seq in seqs:
            row = seq.row
            if row is None or not 0 <= row < self.max_rows:
                raise ValueError(f"sequence {seq.seq_id} uses penalties but has row {row!r}")
            if self._owner[row] != seq.seq_id or self._n_counted[row] != len(seq.output_token_ids):
                prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.int64, device=self.device)
                output = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=self.device)
                self.prompt_mask[row].zero_()
                self.prompt_mask[row, prompt] = True
                self.output_counts[row] = torch.bincount(output, minlength=self.vocab_size)
                self._owner[row] = seq.seq_id
                self._n_counted[row] = len(seq.output_token_ids)
            rows.append(row)
        return rows

    def _count_chosen(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        assert self.output_counts is not None
        rows: list[int] = []
        chosen: list[int] = []
        for seq, token in zip(seqs, token_ids):
            if seq.params.uses_penalties:
                assert seq.row is not None
                rows.append(seq.row)
                chosen.append(token)
                self._n_counted[seq.row] = len(seq.output_token_ids) + 1
        index = (torch.tensor(rows, device=self.device), torch.tensor(chosen, device=self.device))
        self.output_counts.index_put_(
            index, torch.ones(len(rows), dtype=torch.int32, device=self.device), accumulate=True
        )

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Draw one token per row of ``logits`` ``[R, V]`` (modified in place) for non-greedy ``seqs``."""
        device = logits.device
        logits.div_(torch.tensor([s.params.temperature for s in seqs], device=device)[:, None])
        rows = [i for i, s in enumerate(seqs) if s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0.0]
        if rows:  # only rows with a filter (an unfiltered row would make every row sort its whole vocabulary)
            params = [seqs[i].params for i in rows]
            filtered = _filter_logits(
                logits if len(rows) == len(seqs) else logits[rows],
                torch.tensor([p.top_k for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
            )
            if len(rows) == len(seqs):
                logits = filtered
            else:
                logits[rows] = filtered
        return _inverse_cdf_draw(logits.softmax(dim=-1), self._uniforms(seqs))

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One fp64 draw in [0, 1) per sequence: from its own generator if it has one, else (in row
        order) from the sampler's."""
        draws = torch.empty(len(seqs), dtype=torch.float64, device=self.device)
        shared = [j for j, s in enumerate(seqs) if s.generator is None]
        if shared:
            draws[shared] = torch.rand(len(shared), dtype=torch.float64, device=self.device, generator=self._generator)
        for j, seq in enumerate(seqs):
            if seq.generator is not None:
                draws[j] = torch.rand(1, dtype=torch.float64, device=self.device, generator=seq.generator)[0]
        return draws


def _inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row ``r``'s token: the first index whose fp64 running sum of ``probs[r]`` exceeds
    ``uniforms[r]`` times the row's total. A zero-probability token is never chosen (its running
    sum equals its predecessor's). One random number per row, where the exponential race needs a
    row's worth (on CPU, drawing those costs more than the rest of the step's sampling)."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    targets = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def _plain_greedy(seq: Sequence) -> bool:
    """Greedy with no logit bias, penalties or logprobs (a grammar's mask may still apply)."""
    params = seq.params
    return params.is_greedy and not params.logit_bias and not params.uses_penalties and params.logprobs is None


def takes_first_maxima(seqs: list[Sequence], eos_token_ids: set[int]) -> bool:
    """Whether :meth:`Sampler.sample` picks each of ``seqs``' tokens as the first maximal entry of its
    logits row as given (greedy; no logit bias, penalties, logprobs, grammar or banned tokens); it
    stays so as the sequences grow (a ban only lifts once ``min_tokens`` are out)."""
    return all(_plain_greedy(seq) and seq.grammar is None and not _banned_ids(seq, eos_token_ids) for seq in seqs)


def _banned_ids(seq: Sequence, eos_token_ids: set[int]) -> set[int]:
    """Token ids forbidden for ``seq`` this step: stop tokens (and EOS) while min_tokens is unmet."""
    params = seq.params
    if len(seq.output_token_ids) >= params.min_tokens:
        return set()
    banned = set(seq.stop_token_ids)
    if not params.ignore_eos:
        banned |= eos_token_ids
    return banned


def _mark_dead_ends(
    token_ids: list[int],
    grammar_rows: list[int],
    dead: torch.Tensor | None,
    logprobs: list[dict[int, Logprob] | None],
) -> None:
    """``NO_ALLOWED_TOKEN`` (and no logprobs) for each of ``grammar_rows`` whose entry of ``dead``
    (bool, one per grammar row; None: no grammar rows) is true."""
    if dead is None:
        return
    for i, is_dead in zip(grammar_rows, dead.tolist()):
        if is_dead:
            token_ids[i], logprobs[i] = NO_ALLOWED_TOKEN, None
