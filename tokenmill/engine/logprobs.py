"""Logprobs: a token's log-probability and rank under the fp32 log-softmax of a logits row, with the
row's most likely tokens (vLLM's ``logprobs`` and ``prompt_logprobs`` entries).

Values are floored at ``LOGPROB_FLOOR``, so they are always finite; a token's rank is 1 + the number
of tokens with a strictly larger logprob.
"""

from __future__ import annotations

import itertools

import torch

from tokenmill.engine.sequence import Sequence
from tokenmill.request import LOGPROB_FLOOR, Logprob


def sampled_logprobs(
    raw_logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]
) -> list[dict[int, Logprob] | None]:
    """Chosen token plus the top ``params.logprobs`` tokens of the raw distribution, per sequence
    (None for a sequence that did not ask); see :func:`token_logprobs`."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    index = torch.tensor(rows, device=raw_logits.device)
    entries = token_logprobs(
        raw_logits[index], [token_ids[i] for i in rows], [seqs[i].params.logprobs or 0 for i in rows]
    )
    result: list[dict[int, Logprob] | None] = [None] * len(seqs)
    for i, entry in zip(rows, entries):
        result[i] = entry
    return result


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_k: list[int]) -> list[dict[int, Logprob]]:
    """Per row of ``logits`` ``[R, V]``: ``token_ids[r]`` plus the ``top_k[r]`` most likely tokens
    under the fp32 log-softmax of the row (also what prompt logprobs are).

    A token's rank is 1 + the number of tokens with a strictly larger logprob (ties share a rank).
    The given token comes first in each dict. Values are floored at ``LOGPROB_FLOOR`` (NaN and -inf
    included), so they are always finite.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
    chosen = torch.tensor(token_ids, device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen[:, None])
    chosen_rank = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(max(top_k, default=0), dim=-1)
    top_rank = torch.searchsorted(-top_lp, -top_lp, side="left") + 1

    chosen_lp_list, chosen_rank_list = chosen_lp[:, 0].tolist(), chosen_rank.tolist()
    top_lp_list, top_ids_list, top_rank_list = top_lp.tolist(), top_ids.tolist(), top_rank.tolist()
    result = []
    for r, (token, k) in enumerate(zip(token_ids, top_k)):
        entry = {token: Logprob(chosen_lp_list[r], chosen_rank_list[r])}
        for top, value, rank in zip(top_ids_list[r][:k], top_lp_list[r][:k], top_rank_list[r][:k]):
            entry.setdefault(top, Logprob(value, rank))
        result.append(entry)
    return result


def prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Sequence, range]]) -> list[list[dict[int, Logprob]]]:
    """Per span ``(sequence, positions)``: the entries of prompt tokens ``p + 1`` for ``p`` in
    ``positions`` (the actual token plus the top ``params.prompt_logprobs``), from the rows of
    ``logits`` that hold the spans' positions in order."""
    targets: list[int] = []
    top_k: list[int] = []
    for seq, positions in spans:
        targets += seq.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        top_k += [seq.params.prompt_logprobs or 0] * len(positions)
    entries = token_logprobs(logits, targets, top_k) if targets else []
    starts = list(itertools.accumulate((len(p) for _, p in spans), initial=0))
    return [entries[a:b] for a, b in itertools.pairwise(starts)]
