"""A step's plan as the plain data every rank runs (:class:`~tokenmill.worker.forward_step.ForwardStep`).

Batch order: decode sequences (one token each), verifications (a sequence's last token and its
proposal, as one-token requests), then prefill chunks. Logits come back for the sampled rows
(``plan.sample_seqs`` order, a forked child sharing its parent's row), then every row of each
verification in order, then the positions of ``plan.prompt_logprobs`` in order, then the scoring
sequences' pooling positions (their logits row: a decoder's vocabulary, an encoder's head). An
embedding sequence gets no logits row; the final-normed hidden states of its positions of
``plan.pooling`` come back in that order. Token type ids go along when some sequence of the step
has them (an encoder's text pairs). ``engine/logit_rows.py`` takes the rows apart again.
"""

from __future__ import annotations

import torch

from tokenmill.cache.storage import ReqToTokenPool
from tokenmill.engine.scheduler import StepPlan
from tokenmill.engine.sequence import Sequence
from tokenmill.worker.forward_step import ForwardStep, TableWrites


def forward_step(plan: StepPlan, req_pool: ReqToTokenPool, device: torch.device) -> ForwardStep:
    """The plan as plain data, with the table entries written since the previous step. A
    verification is ``1 + k`` one-token requests on its table row, token ``i`` at position
    ``p + i`` seeing positions ``0 .. p + i`` (what a decode step of that length sees): a step
    without prefill chunks stays a decode step, whichever execution path runs it."""
    rows: list[int] = []
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    ids: list[int] = []
    lora_slots: list[int] = []  # each row's adapter slot (-1: the base model)
    segments = any(seq.token_type_ids is not None for seq, _ in plan.prefill)
    for seq in plan.decode:
        rows.append(seq.row)
        seq_lens.append(seq.n_kv)
        extend_lens.append(1)
        ids.append(seq.last_token)
        lora_slots.append(seq.lora_slot)
    for v in plan.verify:
        start = v.seq.n_kv - len(v.proposal) - 1
        rows += [v.seq.row] * (1 + len(v.proposal))
        seq_lens += range(start + 1, v.seq.n_kv + 1)
        extend_lens += [1] * (1 + len(v.proposal))
        ids += [v.seq.last_token, *v.proposal]
        lora_slots += [v.seq.lora_slot] * (1 + len(v.proposal))
    logits_rows: list[int] | None = None if plan.is_pure_decode else list(range(len(plan.decode)))
    first_row: dict[int, int] = {}  # id(sequence) -> the row of its position 0 in the flat batch
    token_types: list[int] = [0] * len(ids)  # filled only when ``segments``
    verify_rows = range(len(plan.decode), len(ids))
    for seq, n in plan.prefill:
        start = seq.n_kv - n
        first_row[id(seq)] = len(ids) - start
        rows.append(seq.row)
        seq_lens.append(seq.n_kv)
        extend_lens.append(n)
        ids.extend(seq.tokens(start, seq.n_kv))
        lora_slots += [seq.lora_slot] * n
        if segments:
            token_types += seq.token_type_ids[start : seq.n_kv] if seq.token_type_ids else [0] * n
        if seq.n_kv == seq.n_tokens and seq.pooling is None:
            logits_rows.extend([len(ids) - 1] * (1 + len(plan.children(seq))))  # forked children share it
    if logits_rows is not None:
        logits_rows += verify_rows
        for seq, positions in plan.prompt_logprobs:  # prefill steps only
            logits_rows.extend(first_row[id(seq)] + p for p in positions)
    embeds, scores = split_pooling(plan)
    if logits_rows is not None:
        logits_rows.extend(first_row[id(seq)] + p for seq, span in scores for p in span)
    hidden_rows = [first_row[id(seq)] + p for seq, span in embeds for p in span]
    positions = [p for n, e in zip(seq_lens, extend_lens) for p in range(n - e, n)]
    parts = ([plan.decode_slots] if plan.decode else []) + [v.slots for v in plan.verify] + plan.prefill_slots
    fork_src = [f.src_slots for f in plan.forks]
    fork_dst = [f.dst_slots for f in plan.forks]
    no_slots = torch.empty(0, dtype=torch.int64)
    writes = req_pool.take_journal()
    return ForwardStep(
        is_decode=plan.is_pure_decode,
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        out_cache_loc=torch.cat(parts).to(device, torch.int64),
        rows=rows,
        seq_lens=seq_lens,
        prefix_lens=[n - e for n, e in zip(seq_lens, extend_lens)],
        logits_indices=None if logits_rows is None else torch.tensor(logits_rows, dtype=torch.int64, device=device),
        fork_src=(torch.cat(fork_src) if fork_src else no_slots).to(device, torch.int64),
        fork_dst=(torch.cat(fork_dst) if fork_dst else no_slots).to(device, torch.int64),
        table_writes=TableWrites(*(w.to(device) for w in writes)),
        hidden_indices=torch.tensor(hidden_rows, dtype=torch.int64, device=device) if hidden_rows else None,
        lora_slots=torch.tensor(lora_slots, device=device) if max(lora_slots, default=-1) >= 0 else None,
        token_type_ids=torch.tensor(token_types, device=device) if segments else None,
    )


def split_pooling(plan: StepPlan) -> tuple[list[tuple[Sequence, range]], list[tuple[Sequence, range]]]:
    """The plan's pooling positions: embedding sequences' (hidden states), then scoring ones' (a logits row each)."""
    embeds = [(seq, span) for seq, span in plan.pooling if seq.pooling is not None and seq.pooling.task == "embed"]
    scores = [(seq, span) for seq, span in plan.pooling if seq.pooling is not None and seq.pooling.task == "score"]
    return embeds, scores
