"""Logits processors: the penalties and the min-p / top-k / top-p filters that the sampler
(``engine/sampler.py``) applies to a batch's logits rows before it draws.

:func:`apply_penalties`: repetition / frequency / presence penalties from per-row prompt masks and
output token counts. :func:`_filter_logits`: min-p and top-k, then top-p over what they left; kept
tokens keep their logits, the others become ``-inf``. Neither modifies its inputs.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Return a penalized copy of ``logits`` ``[N, V]``; the inputs are not modified.

    ``prompt_mask`` ``[N, V]`` (bool) marks tokens in each row's prompt and ``output_counts``
    ``[N, V]`` counts them in its output. Per row ``i`` with penalties ``repetition[i]``,
    ``frequency[i]``, ``presence[i]`` (each ``[N]``):
    a token seen in the prompt or output becomes ``l / r`` if ``l > 0`` else ``l * r``; then
    ``f * count`` and ``p * (count > 0)`` are subtracted.
    """
    counts = output_counts.to(logits.dtype)
    in_output = output_counts > 0
    scale = torch.where(prompt_mask | in_output, repetition[:, None].to(logits.dtype), 1.0)
    penalized = torch.where(logits > 0, logits / scale, logits * scale)
    return penalized - frequency[:, None] * counts - presence[:, None] * in_output.to(logits.dtype)


PREFILTER_WIDTHS = (256, 4096)
"""How many of a row's largest logits are tried, in turn, for top-p and min-p without top-k: a row
whose kept tokens provably lie among them sorts only those (``_sorted_candidates``)."""

CandidateGroup = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(rows, sorted logits [n, W], their token ids [n, W], tail [n])``: each row's W largest logits in
descending order, and the probability mass of the row's other tokens that survive its top-k and
min-p, in units of the W candidates' mass (what top-p's renormalization must still count)."""


def _filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Return ``logits`` ``[R, V]`` with tokens outside min-p / top-k / top-p set to ``-inf``.

    ``top_k[i] <= 0``, ``top_p[i] == 1`` and ``min_p[i] == 0`` disable the filter for row ``i``.
    Min-p and top-k drop first; top-p keeps the shortest most likely run whose mass, renormalized
    over the tokens they left, reaches ``top_p``; the most likely token always survives. A row sorts
    only the candidates ``_sorted_candidates`` finds (sorting whole vocabularies costs more than a
    decode step's forward): every token it keeps is among them.
    """
    out = torch.full_like(logits, float("-inf"))
    groups = _sorted_candidates(logits, top_k, top_p, min_p)
    for rows, sorted_logits, order, tail in groups:
        kept = _filter_sorted(sorted_logits, top_k[rows], top_p[rows], min_p[rows], tail)
        if len(groups) == 1:  # every row, in order
            return out.scatter_(-1, order, kept)
        row_out = torch.full((len(rows), logits.shape[-1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        out[rows] = row_out.scatter_(-1, order, kept)
    return out


def _filter_sorted(
    sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, tail: torch.Tensor
) -> torch.Tensor:
    """``sorted_logits`` ``[R, W]`` (each row's largest, descending) with the filtered ones ``-inf``;
    ``tail`` as in :data:`CandidateGroup`."""
    probs = sorted_logits.softmax(dim=-1)
    drop = probs < min_p[:, None] * probs[:, :1]
    positions = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    drop |= (top_k[:, None] > 0) & (positions[None, :] >= top_k[:, None])
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / (probs.sum(dim=-1, keepdim=True) + tail[:, None])
    mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token
    drop |= (top_p[:, None] < 1.0) & (mass_before >= top_p[:, None]) & (positions[None, :] > 0)
    return sorted_logits.masked_fill(drop, float("-inf"))


def _sorted_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> list[CandidateGroup]:
    """Groups covering every row once, each row with as many of its largest logits as hold every token
    it keeps: ``max(top_k)`` when every row has a top-k; else the first of ``PREFILTER_WIDTHS`` where
    its top-k fits, the last of them is below its min-p bound, or the mass of those that survive
    min-p reaches its top-p share of every survivor's (each with a margin for rounding); else its
    whole vocabulary."""
    vocab = logits.shape[-1]
    everyone = torch.arange(logits.shape[0], device=logits.device)
    no_tail = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    if int(top_k.min()) > 0 and int(top_k.max()) < vocab:
        return [(everyone, *logits.topk(int(top_k.max()), dim=-1), no_tail)]
    groups, pending = [], everyone
    log_total = logits.logsumexp(dim=-1)
    for width in PREFILTER_WIDTHS:
        if width >= vocab or not pending.numel():
            break
        values, order = logits[pending].topk(width, dim=-1)
        candidates = (values - log_total[pending, None]).exp()  # probabilities over the whole row
        k, p, m = top_k[pending], top_p[pending], min_p[pending]
        bound = (m * candidates[:, 0])[:, None]
        kept_mass = (candidates * (candidates >= bound)).sum(dim=-1)
        survivors = torch.ones_like(kept_mass)  # every token survives min-p 0
        if bool((m > 0.0).any()):
            row_probs = (logits[pending] - log_total[pending, None]).exp()
            survivors = (row_probs * (row_probs >= bound)).sum(dim=-1)
        tail = torch.where((k > 0) & (k <= width), 0.0, (survivors - kept_mass).clamp(min=0.0))
        covered = (k > 0) & (k <= width)
        covered |= (m > 0.0) & (candidates[:, -1] * (1 + 1e-4) < bound[:, 0])
        covered |= (k <= 0) & (p < 1.0) & (kept_mass >= (p + 1e-4) * survivors)
        if bool(covered.any()):
            groups.append((pending[covered], values[covered], order[covered], (tail / candidates.sum(dim=-1))[covered]))
            pending = pending[~covered]
    if pending.numel():
        groups.append((pending, *logits[pending].sort(dim=-1, descending=True), no_tail[: pending.numel()]))
    return groups
