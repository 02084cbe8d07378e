"""Speculative decoding's verification side (``engine/speculation.py`` plans the proposals).

After a step, :func:`verify` runs the sampler over each :class:`Verification`'s ``1 + k`` rows of
logits (its last token's and its proposals') in rounds: round ``j``
samples row ``j`` of every sequence still going, with the sampler's ordinary rules (penalties,
grammar masks, logprobs, seeds) and the sequence's state as the output stage left it after the
previous rounds' tokens; the token is appended through the output stage (stop rules; each request's
delta is emitted once, after the last round). A
sequence goes on to round ``j + 1`` while its token equals proposal ``j``; the first token that
differs (or the one after the last proposal) is its last this step. (When every sequence is plain
greedy, ``sampler.takes_first_maxima``, the rounds take the rows' first maxima from one pass over
all of them: the tokens the sampler would pick.) So every emitted token is one
the target model sampled from its own distribution given exactly the tokens before it: greedy
output equals non-speculative greedy output, and sampling draws from the same distribution (a
proposal is a single token, for which drawing from the target and accepting on equality is the
speculative-sampling rule; a seeded sequence draws the same numbers in the same order). Before a
sequence's last token of the step is appended, its KV is cut back to the tokens it holds
(``CacheManager.truncate``): the rejected proposals' slots are released and never cached.
"""

from __future__ import annotations

import torch

from tokenmill.cache.manager import CacheManager
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.request_state import RequestState
from tokenmill.engine.sampler import Sampler, SampleResult, takes_first_maxima
from tokenmill.engine.speculation import Speculator, Verification
from tokenmill.kernels.first_maxima import first_maxima


def acceptance(sampled: int, proposed: int) -> tuple[int, bool]:
    """The speculative-sampling rule for a proposal of one token (a point mass): emit the token the
    target drew; the proposal is accepted when they are equal."""
    return sampled, sampled == proposed


def verify(
    verifications: list[Verification],
    logits: torch.Tensor,
    sampler: Sampler,
    output: OutputProcessor,
    cache: CacheManager,
    eos_token_ids: set[int],
    speculator: Speculator,
) -> None:
    """Emit each verification's tokens from its ``1 + k`` rows of ``logits`` (verifications in order),
    as the module docstring says, and tell ``speculator`` how many of each proposal were accepted.
    A sequence whose sampling fails fails alone."""
    first_row, row = {}, 0
    for v in verifications:
        first_row[id(v.seq)] = row
        row += 1 + len(v.proposal)
    proposals = {id(v.seq): v.proposal for v in verifications}
    stats = speculator.stats
    stats.verify_steps += 1
    stats.proposed_tokens += sum(map(len, proposals.values()))
    accepted_of = dict.fromkeys(proposals, 0)
    going = [v.seq for v in verifications]
    touched: dict[str, RequestState] = {}  # requests given tokens: emitted once, after the last round
    # plain greedy sequences: every round's tokens are the rows' first maxima, taken in one pass
    maxima = first_maxima(logits) if takes_first_maxima(going, eos_token_ids) else None
    for j in range(1 + max(map(len, proposals.values()))):
        going = [seq for seq in going if not seq.is_finished]
        if not going:
            break
        if maxima is not None:
            tokens = [maxima[first_row[id(seq)] + j] for seq in going]
            sampled, result, failures = going, SampleResult(tokens, [None] * len(going)), []
        else:
            index = torch.tensor([first_row[id(seq)] + j for seq in going], device=logits.device)
            sampled, result, failures = sampler.sample_isolating_failures(logits[index], going, eos_token_ids)
        for seq, exc in failures:
            output.fail([seq], f"internal error in sampling: {type(exc).__name__}: {exc}")
        going = []
        for i, seq in enumerate(sampled):
            proposal = proposals[id(seq)]
            accepted = False
            if j < len(proposal):
                result.token_ids[i], accepted = acceptance(result.token_ids[i], proposal[j])
            if accepted:
                stats.accepted_tokens += 1
                accepted_of[id(seq)] += 1
                going.append(seq)
            else:  # its last token this step: the KV keeps exactly the tokens it holds
                cache.truncate(seq.kv, seq.n_tokens)
        output.append_all(sampled, result.token_ids, result.logprobs, touched)
    output.emit_all(touched)
    for v in verifications:
        speculator.record(v.seq, accepted_of[id(v.seq)])
