"""Tests for tokenmill.engine.sampler."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.engine.logits_processors import _filter_logits, _sorted_candidates, apply_penalties
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.sequence import Sequence
from tokenmill.request import LOGPROB_FLOOR, SamplingParams

V = 32
EOS = {2}
CPU = torch.device("cpu")


def seq(
    row: int = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    **params: object,
) -> Sequence:
    s = Sequence(prompt_token_ids=list(prompt or [5]), params=SamplingParams(**params))  # type: ignore[arg-type]
    s.output_token_ids = list(output or [])
    s.kv.row = row
    if seed is not None:
        s.generator = torch.Generator().manual_seed(seed)
    return s


def sampler(max_rows: int = 64, seed: int = 0) -> Sampler:
    return Sampler(V, max_rows, CPU, seed=seed)


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = torch.randn(8, V)
    before = logits.clone()
    result = sampler().sample(logits, [seq(row=i, temperature=0.0) for i in range(8)], EOS)
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_general_path_does_not_modify_the_callers_logits() -> None:
    logits = torch.randn(3, V)
    before = logits.clone()
    seqs = [
        seq(row=0, temperature=0.0, logit_bias={3: 50.0}),
        seq(row=1, temperature=0.7, top_k=3, repetition_penalty=1.5, output=[4, 4]),
        seq(row=2, temperature=1.0, min_tokens=2, logprobs=2),
    ]
    sampler().sample(logits, seqs, EOS)
    assert torch.equal(logits, before)


def test_low_precision_logits_are_accepted() -> None:
    logits = torch.randn(4, V).to(torch.bfloat16)
    result = sampler().sample(logits, [seq(row=i, temperature=0.0, logit_bias={0: 0.0}) for i in range(4)], EOS)
    assert result.token_ids == logits.float().argmax(-1).tolist()


def test_temperature_zero_ignores_the_seed() -> None:
    logits = torch.randn(4, V)
    gens = [seq(row=i, seed=100 + i, temperature=0.0, top_k=3) for i in range(4)]
    states = [s.generator.get_state() for s in gens if s.generator is not None]
    first = sampler(seed=1).sample(logits, gens, EOS).token_ids
    second = sampler(seed=2).sample(logits, [seq(row=i, seed=7, temperature=0.0) for i in range(4)], EOS).token_ids
    assert first == second == logits.argmax(-1).tolist()
    assert all(torch.equal(s.generator.get_state(), st) for s, st in zip(gens, states) if s.generator is not None)


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = torch.randn(2, V)
    low = int(logits[0].argmin())
    top = int(logits[1].argmax())
    result = sampler().sample(
        logits,
        [seq(row=0, temperature=1.0, logit_bias={low: 100.0}), seq(row=1, temperature=0.0, logit_bias={top: -100.0})],
        EOS,
    )
    assert result.token_ids[0] == low
    assert result.token_ids[1] == int(logits[1].topk(2).indices[1])


def test_top_k_one_is_greedy_even_at_high_temperature() -> None:
    logits = torch.randn(64, V)
    seqs = [seq(row=i, temperature=5.0, top_k=1) for i in range(64)]
    assert sampler().sample(logits, seqs, EOS).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy() -> None:
    logits = torch.randn(64, V)
    seqs = [seq(row=i, temperature=5.0, top_p=1e-6) for i in range(64)]
    assert sampler().sample(logits, seqs, EOS).token_ids == logits.argmax(-1).tolist()


def test_high_temperature_without_filters_is_random() -> None:
    logits = torch.randn(64, V)
    seqs = [seq(row=i, temperature=5.0) for i in range(64)]
    assert sampler().sample(logits, seqs, EOS).token_ids != logits.argmax(-1).tolist()


def test_random_draws_follow_the_softmax_distribution() -> None:
    """20,000 draws at temperature 2 from one row (some tokens banned by bias): each token's
    frequency is within 4 standard deviations of its probability, banned tokens never appear."""
    torch.manual_seed(0)
    logits = torch.randn(V) * 2
    bias = {3: -math.inf, 17: -math.inf, V - 1: -math.inf}
    expected = torch.softmax((logits + torch.tensor([bias.get(t, 0.0) for t in range(V)])) / 2.0, dim=-1)
    rows, counts = 1000, torch.zeros(V)
    smp = sampler(max_rows=rows)
    for _ in range(20):
        seqs = [seq(row=i, temperature=2.0, logit_bias=bias) for i in range(rows)]
        counts += torch.bincount(torch.tensor(smp.sample(logits.expand(rows, V), seqs, EOS).token_ids), minlength=V)
    n = counts.sum()
    assert all(counts[t] == 0 for t in bias)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() <= 4 * sigma + 1e-9).all(), (counts / n - expected).abs().max()


def _support(logits_row: torch.Tensor, n: int, **params: object) -> set[int]:
    seqs = [seq(row=i, **params) for i in range(n)]
    return set(sampler(max_rows=n).sample(logits_row.expand(n, V), seqs, EOS).token_ids)


def test_min_p_limits_the_support() -> None:
    probs = torch.full((V,), 0.15 / (V - 3))
    probs[:3] = torch.tensor([0.5, 0.2, 0.15])
    logits = probs.log()
    # min_p * max prob = 0.35 * 0.5 = 0.175: only tokens 0 and 1 qualify
    assert _support(logits, 400, temperature=1.0, min_p=0.35) == {0, 1}
    assert len(_support(logits, 400, temperature=1.0)) > 3


def test_top_k_and_top_p_limit_the_support() -> None:
    probs = torch.full((V,), 0.1 / (V - 4))
    probs[:4] = torch.tensor([0.4, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert _support(logits, 400, temperature=1.0, top_k=2) == {0, 1}
    assert _support(logits, 400, temperature=1.0, top_p=0.8) == {0, 1, 2}  # 0.4 + 0.3 < 0.8


def kept_by_definition(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens one row keeps, filter by filter: its ``top_k`` largest logits (all if 0), those with
    at least ``min_p`` times the top probability, then the shortest most likely run of those whose
    renormalized mass before each token is below ``top_p``."""
    probs = logits.double().softmax(-1)
    order = sorted(range(len(probs)), key=lambda t: -float(logits[t]))
    kept = order[:top_k] if top_k > 0 else order
    kept = [t for t in kept if probs[t] >= min_p * probs[order[0]]]
    total, mass, result = sum(float(probs[t]) for t in kept), 0.0, []
    for t in kept:
        if result and top_p < 1.0 and mass >= top_p:
            break
        result.append(t)
        mass += float(probs[t]) / total
    return set(result)


TOP_K_ROWS = [(3, 1.0, 0.0), (40, 0.7, 0.0), (12, 0.95, 0.05), (1, 1.0, 0.0), (25, 0.5, 0.2), (60, 1.0, 0.0)]
TOP_P_ROWS = [(0, 0.9, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.05), (0, 0.99, 0.02), (300, 0.8, 0.0), (7, 1.0, 0.0)]


@pytest.mark.parametrize(
    ("settings", "scales", "widths"),
    [
        (TOP_K_ROWS, [3.0] * 6, [60] * 6),  # every row has a top-k: its largest 60 logits
        # peaked rows: the first 256 hold what top-p and min-p keep (top-k 300: the first 4096)
        (TOP_P_ROWS, [5.0] * 6, [256, 256, 256, 256, 4096, 256]),
        (TOP_P_ROWS, [0.05] * 6, [6000, 4096, 6000, 6000, 4096, 256]),  # flat rows: most sort everything
        (TOP_P_ROWS, [5.0, 0.05, 1.0, 5.0, 1.0, 0.05], [256, 4096, 4096, 256, 4096, 256]),
        (TOP_K_ROWS + [(0, 0.9, 0.01)], [5.0] * 7, [256] * 7),
    ],
)
def test_filters_keep_what_their_definitions_keep(settings: list, scales: list[float], widths: list[int]) -> None:
    """min-p, top-k and top-p together, row by row, against their definitions, whichever number of
    candidates each row sorts (the largest 60, 256 or 4096 logits, or all 6000)."""
    noise = torch.randn(len(settings), 6000, generator=torch.Generator().manual_seed(3))
    logits = noise * torch.tensor(scales)[:, None]
    top_k, top_p, min_p = (torch.tensor(column) for column in zip(*settings))
    sorted_widths = [0] * len(settings)
    for rows, values, *_ in _sorted_candidates(logits, top_k, top_p, min_p):
        for row in rows.tolist():
            sorted_widths[row] = values.shape[-1]
    assert sorted_widths == widths
    filtered = _filter_logits(logits.clone(), top_k, top_p, min_p)
    for row, (k, p_, m) in enumerate(settings):
        kept = set(torch.isfinite(filtered[row]).nonzero().flatten().tolist())
        assert kept == kept_by_definition(logits[row], k, p_, m), (row, k, p_, m)
        assert torch.equal(filtered[row, sorted(kept)], logits[row, sorted(kept)])


def test_rows_without_a_filter_keep_every_token_beside_filtered_rows() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    seqs = [seq(0, temperature=1.0), seq(1, temperature=1.0, top_k=1)]
    draws = [sampler(seed=s).sample(logits, seqs, set()).token_ids for s in range(60)]
    assert len({d[0] for d in draws}) > 5  # the unfiltered row draws from many tokens
    assert {d[1] for d in draws} == {int(logits[1].argmax())}


def test_apply_penalties_numerically() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, 1.0, -2.0], [2.0, -1.0, 3.0, 1.0, -2.0]])
    prompt_mask = torch.tensor([[True, True, False, False, False], [False] * 5])
    counts = torch.tensor([[0, 0, 3, 0, 1], [0, 2, 0, 0, 0]], dtype=torch.int32)
    out = apply_penalties(
        logits, prompt_mask, counts, torch.tensor([2.0, 1.0]), torch.tensor([0.5, 0.0]), torch.tensor([0.25, 1.0])
    )
    expected = torch.tensor(
        [
            [2.0 / 2, -1.0 * 2, 3.0 / 2 - 0.5 * 3 - 0.25, 1.0, -2.0 * 2 - 0.5 * 1 - 0.25],
            [2.0, -1.0 - 1.0, 3.0, 1.0, -2.0],
        ]
    )
    assert torch.allclose(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 3.0, 1.0, -2.0]))


def _penalized(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    """Reference: the penalties of ``s`` applied to one row of logits, counted from scratch."""
    p = s.params
    out = logits.clone()
    counts = torch.bincount(torch.tensor(s.output_token_ids, dtype=torch.int64), minlength=V)
    for t in range(V):
        if t in s.prompt_token_ids or counts[t] > 0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return out


@pytest.mark.parametrize(
    "params",
    [{"repetition_penalty": 3.0}, {"frequency_penalty": 1.0}, {"presence_penalty": 2.0}],
)
def test_each_penalty_changes_the_greedy_choice(params: dict[str, float]) -> None:
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 9] = 2.0, 1.5
    # 7 was generated twice (and is in the prompt): every penalty pushes it below 9
    s = seq(prompt=[7], output=[7, 7], temperature=0.0, **params)
    assert sampler().sample(logits, [s], EOS).token_ids == [9]
    assert sampler().sample(logits, [seq(prompt=[7], output=[7, 7], temperature=0.0)], EOS).token_ids == [7]


def _recount(s: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.bincount(torch.tensor(s.output_token_ids, dtype=torch.int64), minlength=V).to(torch.int32)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[s.prompt_token_ids] = True
    return counts, mask


def _assert_state(smp: Sampler, s: Sequence) -> None:
    assert smp.output_counts is not None and smp.prompt_mask is not None and s.row is not None
    counts, mask = _recount(s)
    assert torch.equal(smp.output_counts[s.row], counts)
    assert torch.equal(smp.prompt_mask[s.row], mask)


def test_incremental_counts_match_a_recount_including_recycled_rows() -> None:
    smp = sampler(max_rows=4)
    rng = torch.Generator().manual_seed(3)
    pen = {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}
    a = seq(row=0, prompt=[1, 2, 3], **pen)
    b = seq(row=1, prompt=[4, 4, 5], temperature=1.0, frequency_penalty=0.7)
    plain = seq(row=2, temperature=1.0)

    def step(seqs: list[Sequence]) -> None:
        logits = torch.randn(len(seqs), V, generator=rng)
        tokens = smp.sample(logits, seqs, EOS).token_ids
        # penalized greedy rows equal a stateless reference computed from the full history
        for i, s in enumerate(seqs):
            if s.params.is_greedy:
                assert tokens[i] == int(_penalized(logits[i], s).argmax())
        for s, t in zip(seqs, tokens):
            s.output_token_ids.append(t)

    for _ in range(6):
        step([a, b, plain])
    _assert_state(smp, a)
    _assert_state(smp, b)

    # a finishes; c reuses its row; a new b-like sequence reuses b's row with a different history
    c = seq(row=0, prompt=[9], output=[8, 8], **pen)
    d = seq(row=1, prompt=[6], presence_penalty=1.0, temperature=0.0)
    for _ in range(4):
        step([d, c])
    _assert_state(smp, c)
    _assert_state(smp, d)

    # c is preempted and comes back in row 3; b's old owner d moves to row 2 (previously unpenalized)
    c.kv.row, d.kv.row = 3, 2
    step([c, d])
    _assert_state(smp, c)
    _assert_state(smp, d)


def test_owned_rows_are_updated_incrementally_not_rebuilt() -> None:
    smp = sampler(max_rows=2)
    s = seq(prompt=[1], temperature=0.0, frequency_penalty=0.5)
    for _ in range(3):
        s.output_token_ids += smp.sample(torch.randn(1, V), [s], EOS).token_ids
    assert smp.output_counts is not None
    smp.output_counts[0, 30] += 100  # a marker that a rebuild would erase
    s.output_token_ids += smp.sample(torch.randn(1, V), [s], EOS).token_ids
    assert smp.output_counts[0, 30] >= 100
    # the caller did not append the last sampled token: the row no longer matches and is rebuilt
    s.output_token_ids.pop()
    chosen = smp.sample(torch.randn(1, V), [s], EOS).token_ids
    s.output_token_ids += chosen
    _assert_state(smp, s)


def test_recycled_row_gives_the_same_tokens_as_a_fresh_sampler() -> None:
    used = sampler(max_rows=2)
    old = seq(row=0, prompt=[3, 4, 5], output=[6, 6, 6, 7], temperature=0.0, presence_penalty=2.0)
    used.sample(torch.randn(1, V), [old], EOS)
    new = seq(row=0, prompt=[10], temperature=0.0, presence_penalty=2.0, repetition_penalty=2.0)
    logits = torch.zeros(1, V)
    logits[0, 6] = 1.0  # a leak of old's counts would penalize 6
    assert used.sample(logits, [new], EOS).token_ids == sampler().sample(logits, [new], EOS).token_ids == [6]


def test_seeded_sequence_is_reproducible_in_any_batch_and_row() -> None:
    steps = [torch.randn(V) for _ in range(12)]
    params = {"temperature": 1.3, "presence_penalty": 0.5}  # no filters: alone it skips the sort

    def run(batched: bool) -> list[int]:
        smp = sampler(seed=0 if batched else 99)
        target = seq(row=5 if batched else 0, seed=1234, **params)
        others = [seq(row=r, temperature=1.0, top_k=4) for r in (0, 1, 7)] if batched else []
        for logits in steps:
            rows = others[:1] + [target] + others[1:] if batched else [target]
            batch = torch.stack([logits if s is target else torch.randn(V) for s in rows])
            tokens = smp.sample(batch, rows, EOS).token_ids
            for s, t in zip(rows, tokens):
                s.output_token_ids.append(t)
        return target.output_token_ids

    alone, batched = run(False), run(True)
    assert alone == batched
    assert len(set(alone)) > 1


def test_unseeded_sampling_follows_the_sampler_seed() -> None:
    logits = torch.randn(16, V)

    def draw(seed: int) -> list[int]:
        return sampler(seed=seed).sample(logits, [seq(row=i, temperature=2.0) for i in range(16)], EOS).token_ids

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_tokens(temperature: float) -> None:
    logits = torch.zeros(1, V)
    logits[0, 2], logits[0, 11], logits[0, 12] = 100.0, 90.0, 50.0
    smp = sampler()

    def pick(**params: object) -> int:
        return smp.sample(logits, [seq(temperature=temperature, **params)], EOS).token_ids[0]

    assert pick(min_tokens=2, output=[4], stop_token_ids=[11]) == 12
    assert pick(min_tokens=2, output=[4, 4], stop_token_ids=[11]) == 2
    assert pick(min_tokens=2, output=[4], ignore_eos=True, stop_token_ids=[11]) == 2
    assert pick(min_tokens=2, output=[4]) == 11


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.randn(3, V)
    raw_lp = torch.log_softmax(logits, -1)
    forced = int(logits[0].argsort()[5])  # sixth smallest: far from the top
    seqs = [
        seq(row=0, temperature=0.5, logit_bias={forced: 100.0}, logprobs=3),
        seq(row=1, temperature=0.0, logprobs=0),
        seq(row=2, temperature=0.0),
    ]
    result = sampler().sample(logits, seqs, EOS)
    assert result.token_ids[0] == forced
    assert result.logprobs[2] is None

    first = result.logprobs[0]
    assert first is not None
    top = raw_lp[0].topk(3)
    assert list(first) == [forced, *top.indices.tolist()]
    assert math.isclose(first[forced].logprob, float(raw_lp[0, forced]), rel_tol=1e-5)
    assert first[forced].rank == V - 5
    for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert math.isclose(first[token].logprob, value, rel_tol=1e-5)
        assert first[token].rank == rank

    greedy = result.logprobs[1]
    assert greedy is not None
    best = int(logits[1].argmax())
    assert list(greedy) == [best]
    assert greedy[best].rank == 1
    assert math.isclose(greedy[best].logprob, float(raw_lp[1, best]), rel_tol=1e-5)


def test_logprob_ranks_share_ties() -> None:
    logits = torch.zeros(1, V)
    logits[0, 3] = logits[0, 4] = 1.0
    result = sampler().sample(logits, [seq(temperature=0.0, logprobs=3, logit_bias={9: 5.0})], EOS)
    entry = result.logprobs[0]
    assert entry is not None
    assert result.token_ids == [9]
    assert entry[9].rank == 3  # two tokens have a larger raw logprob
    assert entry[3].rank == entry[4].rank == 1


def test_rejects_mismatched_logits() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        sampler().sample(torch.randn(2, V), [seq()], EOS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_go_to_the_lowest_token_id(dtype: torch.dtype) -> None:
    logits = torch.zeros(3, V, dtype=dtype)
    logits[0, [7, 3, 11]] = 5.0
    logits[1, [V - 1, 1]] = 2.0
    result = sampler().sample(logits, [seq(row=i, temperature=0.0) for i in range(3)], EOS)
    assert result.token_ids == [3, 1, 0]


def test_logprobs_are_always_finite_numbers() -> None:
    """A zero probability (-inf) and non-finite logits (NaN, e.g. after a bad weight update) give
    logprobs of LOGPROB_FLOOR, never a value JSON cannot carry."""
    logits = torch.zeros(2, V)
    logits[0, 3] = float("-inf")  # a token with zero probability
    logits[1] = float("nan")  # a broken model output
    seqs = [seq(row=0, temperature=0.0, logprobs=V), seq(row=1, temperature=0.0, logprobs=3)]
    result = sampler().sample(logits, seqs, EOS)
    for entry in result.logprobs:
        values = [lp.logprob for lp in entry.values()]
        assert all(math.isfinite(v) and v >= LOGPROB_FLOOR for v in values)
    assert result.logprobs[0][3].logprob == LOGPROB_FLOOR
    assert all(lp.logprob == LOGPROB_FLOOR for lp in result.logprobs[1].values())
