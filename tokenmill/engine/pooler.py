"""Pooling: a pooling sequence's final hidden states gathered across its prefill chunks, and its
embedding (or score) once its prompt is complete. Engine thread only.

Each chunk adds the rows the plan named (``StepPlan.pooling``) to ``Sequence.pooled`` in fp32: their
sum for "mean" (a chunk starting at position 0 starts it afresh, so a preempted and recomputed prompt
counts each position once), the row itself for "cls" and "last". The embedding is the mean (or the
row), its first ``dimensions`` values, then L2-normalized when asked: a float32 list. A scoring
sequence's ``pooled`` is its logits row (``engine/logit_rows.py``): the score is the sigmoid of a one-label
head's logit, or ``softmax(no, yes)[yes]`` over a decoder's logits of the token pair.
"""

from __future__ import annotations

import torch

from tokenmill.engine.sequence import Sequence


def gather(spans: list[tuple[Sequence, range]], hidden: torch.Tensor) -> None:
    """Fold ``hidden`` (one row per position of ``spans``, in order) into each sequence's ``pooled``."""
    start = 0
    for seq, positions in spans:
        rows = hidden[start : start + len(positions)].float()
        start += len(positions)
        assert seq.pooling is not None, "only pooling sequences have pooling positions"
        if seq.pooling.pooling != "mean":
            seq.pooled = rows[-1].clone()
        elif positions.start == 0 or seq.pooled is None:
            seq.pooled = rows.sum(0)
        else:
            seq.pooled += rows.sum(0)


def embedding(seq: Sequence) -> list[float]:
    """The embedding of a pooling sequence whose prompt is complete."""
    params = seq.pooling
    assert params is not None and seq.pooled is not None, "a pooling sequence with its prompt computed"
    vector = seq.pooled / len(seq.prompt_token_ids) if params.pooling == "mean" else seq.pooled
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu().tolist()


def score(seq: Sequence, token_ids: tuple[int, int] | None) -> float:
    """The relevance score of a scoring sequence whose prompt is complete (``token_ids``: a decoder
    reranker's ``(no, yes)``; None: the row is a one-label head's)."""
    row = seq.pooled
    assert row is not None, "a scoring sequence with its prompt computed"
    if token_ids is None:
        return float(torch.sigmoid(row[0]))
    return float(torch.softmax(row[list(token_ids)], dim=0)[1])
