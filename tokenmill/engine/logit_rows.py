"""A step's logits taken apart (the order ``engine/forward_inputs.py`` asked for them): the sampled
rows and the verification rows are returned; the prompt logprobs, the embedding sequences' hidden
states (``engine/pooler.py`` gathers them across chunks) and the scoring sequences' logits rows are
stored on their sequences."""

from __future__ import annotations

import torch

from tokenmill.engine import pooler
from tokenmill.engine.forward_inputs import split_pooling
from tokenmill.engine.logprobs import prompt_logprobs
from tokenmill.engine.scheduler import StepPlan


def split_logits(
    plan: StepPlan, logits: torch.Tensor, hidden: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``plan.sample_seqs`` (``[len(sample_seqs), vocab]``) and of the rows of
    ``plan.verify`` (``1 + k`` per verification), after storing the step's prompt logprobs, pooling
    hidden states (``hidden``: the forward's ``hidden_indices`` rows) and scores on their sequences."""
    n_sample = len(plan.sample_seqs)
    n_scored = n_sample + sum(1 + len(v.proposal) for v in plan.verify)
    spans = plan.prompt_logprobs
    for (seq, _), entries in zip(spans, prompt_logprobs(logits[n_scored:], spans)):
        seq.prompt_logprobs.extend(entries)
    embeds, scores = split_pooling(plan)
    if embeds:
        assert hidden is not None, "a step with pooling positions returns hidden states"
        pooler.gather(embeds, hidden)
    score_rows = n_scored + sum(len(positions) for _, positions in spans)
    for i, (seq, _) in enumerate(scores):
        seq.pooled = logits[score_rows + i].float()
    return logits[:n_sample], logits[n_sample:n_scored]
