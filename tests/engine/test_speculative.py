"""Speculative decoding (n-gram prompt lookup): the output equals plain decoding's, token for token
(greedy, and seeded sampling: the same draws in the same order), with every feature a decode step
has; unseeded sampling has plain decoding's distribution (and a wrong acceptance rule is caught);
rejected proposals leave no KV behind; bad settings are refused."""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from tests.engine.test_siblings import pages_held_only_by_the_prefix_cache
from tests.engine.test_weight_updates import weights_for
from tests.model.test_gemma import FAMILIES as GEMMA_FAMILIES
from tests.model.test_moe import FAMILIES as MOE_FAMILIES
from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workload import make_workload
from tokenmill.cli import build_parser, config_from_args
from tokenmill.config import EngineConfig
from tokenmill.engine import verifier
from tokenmill.metrics import ServerMetrics
from tokenmill.request import RequestOutput, StructuredOutputsParams, accumulate
from tokenmill.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 1000}
"""Speculate at any batch size, on any 1-gram match (the tiny model's loops give both accepted and
rejected proposals)."""
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], list(range(20, 60)) + list(range(20, 30))]


def make_llm(speculative: bool, **options) -> LLM:
    extra = {"speculative_config": NGRAM} if speculative else {}
    return LLM(**{"dtype": "float32", "num_kv_slots": 2048, **extra, **options})


@pytest.fixture(scope="module")
def plain() -> Iterator[LLM]:
    llm = make_llm(False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec() -> Iterator[LLM]:
    llm = make_llm(True)
    yield llm
    llm.shutdown()


def run(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


def spec_stats(llm: LLM) -> dict[str, int]:
    return llm.engine.stats()["speculative"]


def test_greedy_output_is_plain_decoding_and_proposals_are_both_accepted_and_rejected(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = spec_stats(spec)
    assert run(spec, PROMPTS, params) == run(plain, PROMPTS, params)
    after = spec_stats(spec)
    proposed = after["proposed_tokens"] - before["proposed_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert 0 < accepted < proposed
    assert pages_held_only_by_the_prefix_cache(spec)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=3, seed=1),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, min_tokens=5),
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=7, top_k=5),
        SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, n=2, seed=3, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["e"]),
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex="(ab|cd)+x")),
    ],
    ids=["logprobs", "n3", "penalties-min-tokens", "seeded", "seeded-n2-presence", "stop-string", "regex"],
)
def test_every_decode_feature_gives_plain_decodings_output(plain: LLM, spec: LLM, params: SamplingParams) -> None:
    ours = spec.generate(PROMPTS, params, use_tqdm=False)
    theirs = plain.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ours, theirs):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids,
                y.text,
                y.finish_reason,
                y.stop_reason,
            )
            if params.logprobs is not None:  # the verification rows' logits: the same up to summation order
                for mine, yours in zip(x.logprobs, y.logprobs, strict=True):
                    assert mine.keys() == yours.keys()
                    for token in mine:
                        assert mine[token].logprob == pytest.approx(yours[token].logprob, abs=1e-4)
    assert pages_held_only_by_the_prefix_cache(spec)


@pytest.mark.parametrize(
    "options",
    [
        dict(page_size=4, max_num_batched_tokens=8),  # chunked prefill beside verifications
        dict(page_size=1, enable_prefix_caching=False),
        dict(page_size=4, num_kv_slots=96, max_running_requests=4),  # preemptions
    ],
    ids=["chunked-prefill", "page-1-no-prefix-cache", "preemption"],
)
def test_greedy_output_is_plain_decoding_under_batching_pressure(options: dict) -> None:
    prompts = [PROMPTS[i % 3][: 8 + i] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = []
    for speculative in (False, True):
        llm = make_llm(speculative, **options)
        try:
            outputs.append(run(llm, prompts, params))
            if speculative:
                assert spec_stats(llm)["accepted_tokens"] > 0
                if options.get("num_kv_slots") == 96:
                    assert llm.engine.stats()["scheduler"]["preemptions"] > 0
                assert pages_held_only_by_the_prefix_cache(llm)
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


def continuations(llm: LLM, prompt: list[int], draws: int) -> collections.Counter:
    """``draws`` sampled 3-token continuations of ``prompt``, 100 requests at a time (so the step's
    token budget leaves every sequence its proposal)."""
    params = SamplingParams(temperature=2.0, top_k=2, max_tokens=4, ignore_eos=True)
    outcomes = collections.Counter()
    for _ in range(draws // 100):
        outcomes.update(tuple(c[0]) for c in run(llm, [prompt] * 100, params))
    return outcomes


def total_variation(a: collections.Counter, b: collections.Counter) -> float:
    n_a, n_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / n_a - b[k] / n_b) for k in a.keys() | b.keys())


def test_unseeded_sampling_has_plain_decodings_distribution_and_a_wrong_rule_is_caught(
    plain: LLM, spec: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt ends where it repeats the model's own greedy continuation, so the proposals are
    likely tokens (proposed and often, not always, drawn); 1200 draws of 4 tokens (temperature 2,
    top-2: at most 16 outcomes) per engine, total variation 0.03 apart when measured. 300 draws
    with "always accept the proposal" must be far off (0.9 when measured)."""
    seed_prompt = [31, 32, 33]
    (greedy,) = run(plain, [seed_prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    prompt = seed_prompt + greedy + seed_prompt
    reference = continuations(plain, prompt, 1200)
    before = spec_stats(spec)
    ours = continuations(spec, prompt, 1200)
    assert spec_stats(spec)["accepted_tokens"] > before["accepted_tokens"]
    assert total_variation(ours, reference) < 0.1, (ours, reference)
    monkeypatch.setattr(verifier, "acceptance", lambda sampled, proposed: (proposed, True))
    wrong = continuations(spec, prompt, 300)
    assert total_variation(wrong, reference) > 0.3, (wrong, reference)


def test_prompt_lookup_by_default_speculates_while_at_most_two_sequences_decode() -> None:
    """Without ``disable_by_batch_size``: two sequences decoding side by side verify proposals;
    three that decode in step with each other from first token to last never do."""
    setting = {key: value for key, value in NGRAM.items() if key != "disable_by_batch_size"}
    llm = LLM(dtype="float32", num_kv_slots=2048, speculative_config=setting)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    looping = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 6]
    try:
        verified = []
        for prompts in (looping[:2], looping):
            before = spec_stats(llm)["verify_steps"]
            run(llm, prompts, params)
            verified.append(spec_stats(llm)["verify_steps"] - before)
    finally:
        llm.shutdown()
    assert verified[0] > 0 and verified[1] == 0


def test_a_step_verifies_many_tokens_at_once(spec: LLM) -> None:
    """A copying prompt at batch 1: fewer steps than tokens."""
    prompt = list(range(30, 70)) * 2 + list(range(30, 34))
    steps = spec.engine.stats()["scheduler"]["steps"]
    run(spec, [prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert spec.engine.stats()["scheduler"]["steps"] - steps < 32


def test_a_verification_streams_its_tokens_as_one_delta(plain: LLM, spec: LLM) -> None:
    """Each step sends one delta per request, however many tokens its verification emitted; the
    deltas add up to plain decoding's tokens and text."""
    prompt = list(range(30, 70)) * 2 + list(range(30, 34))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    deltas, done = [], threading.Event()

    def collect(delta) -> None:
        deltas.append(delta)
        if delta.finished:
            done.set()

    spec.engine.add_request(prompt, params, collect)
    assert done.wait(60)
    [expected] = plain.generate([prompt], params, use_tqdm=False)
    streamed = [d.outputs[0] for d in deltas if d.outputs]
    assert [t for c in streamed for t in c.token_ids] == expected.outputs[0].token_ids
    assert "".join(c.text for c in streamed) == expected.outputs[0].text
    assert max(len(c.token_ids) for c in streamed) > 1
    assert len(streamed) < len(expected.outputs[0].token_ids)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
        (dict(NGRAM, prompt_lookup_min=5, prompt_lookup_max=2), "prompt_lookup_max must be an integer in"),
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key"),
        ({"num_speculative_tokens": 3}, "needs 'method'"),
        ("ngram", "must be a JSON object"),
    ],
)
def test_bad_settings_are_refused_before_the_engine_starts(setting, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(dtype="float32", speculative_config=setting)


def test_verification_rows_hold_the_proposals_kv_until_rejected(spec: LLM) -> None:
    """After a run no sequence holds KV and every page is free or cached, with the cached pages'
    tokens being the outputs' (no rejected proposal in the prefix cache): a second run of the same
    prompt and its output as a prompt hits the cache and continues as plain decoding would."""
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    (first,) = run(spec, [prompt], params)[0]
    assert pages_held_only_by_the_prefix_cache(spec)
    (again,) = run(spec, [prompt + first[:10]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert again == first[10:]


def test_prometheus_reports_proposed_and_accepted_tokens_per_method(spec: LLM) -> None:
    run(spec, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    text = ServerMetrics(spec.engine).render().decode()
    stats = spec_stats(spec)
    samples = {
        name: value
        for family in text_string_to_metric_families(text)
        for name, labels, value, *_ in family.samples
        if name.startswith("tokenmill_spec_decode") and labels == {"method": "ngram"}
    }
    assert samples == {
        "tokenmill_spec_decode_num_draft_tokens_total": stats["proposed_tokens"],
        "tokenmill_spec_decode_num_accepted_tokens_total": stats["accepted_tokens"],
        "tokenmill_spec_decode_acceptance_rate": stats["accepted_tokens"] / stats["proposed_tokens"],
    }


def test_the_command_line_takes_the_setting_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--speculative-config", json.dumps(NGRAM)])
    assert config_from_args(EngineConfig, args).speculative() == SpeculativeConfig.from_dict(NGRAM)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--speculative-config", "{method: ngram}"])
    out_of_range = json.dumps(dict(NGRAM, num_speculative_tokens=17))
    args = parser.parse_args(["serve", "--speculative-config", out_of_range])
    with pytest.raises(SystemExit) as exited:
        config_from_args(EngineConfig, args)
    assert exited.value.code == 2
    assert "tokenmill: error: speculative_config: num_speculative_tokens must be an integer in [1, 16], got 17" in (
        capsys.readouterr().err
    )


def test_a_grammar_cuts_a_proposal_at_the_first_token_it_refuses(spec: LLM) -> None:
    """The matcher checks a proposal without moving: a choice between two texts accepts the tokens of
    one of them, up to where the other's begin, and then its state is what it was."""
    engine = spec.engine
    tokens = engine.tokenizer.hf.encode(" alpha beta gamma", add_special_tokens=False)
    other = engine.tokenizer.hf.encode(" delta", add_special_tokens=False)
    compiler = engine._intake.grammars
    grammar = compiler.new_sequence_grammar(compiler.compile(StructuredOutputsParams(choice=[" alpha beta gamma"])))
    mask = grammar.bitmask.clone()
    assert grammar.accepted_prefix(tokens + other) == len(tokens)
    assert grammar.accepted_prefix(other + tokens) == 0
    assert torch.equal(grammar.bitmask, mask)
    for token in tokens:  # the state is untouched: the whole choice still goes through
        grammar.advance(token)
    assert grammar.finished


def test_the_throughput_benchmark_reports_the_runs_proposals(spec: LLM) -> None:
    work = make_workload(2, (4, 8), (24, 24), vocab_size=spec.engine.model_config.vocab_size, seed=0)
    before = spec_stats(spec)
    result, _ = run_throughput(spec, work)
    after = spec_stats(spec)
    # the run's own counts: those of the whole call but its short warm-up
    assert 0 < result.spec_proposed_tokens <= after["proposed_tokens"] - before["proposed_tokens"]
    assert 0 <= result.spec_accepted_tokens <= after["accepted_tokens"] - before["accepted_tokens"]
    assert result.spec_accepted_tokens <= result.spec_proposed_tokens


def generate_across_an_update(
    checkpoint: Path, speculative: bool, update_after: int, update: list[tuple[str, torch.Tensor]]
) -> tuple[list[int], list[int], list[int]]:
    """Greedy tokens of PROMPTS[0] and their weight versions, with ``update`` applied between the step
    that brings the output to at least ``update_after`` tokens and the next (the callback holds the
    engine thread until the update is queued; commands run before every step); and the proposed
    tokens counted then and at the end."""
    llm = make_llm(speculative, model=str(checkpoint))
    engine = llm.engine
    due, done = threading.Event(), threading.Event()
    total: list[RequestOutput | None] = [None]
    observed: list[int] = []
    proposed = [0, 0]

    def on_output(delta: RequestOutput) -> None:  # on the engine thread, right after the delta's step
        total[0] = accumulate(total[0], delta)
        observed.extend([engine.weight_version] * sum(len(c.token_ids) for c in delta.outputs))
        if delta.finished:
            done.set()
        elif len(observed) >= update_after and not due.is_set():
            proposed[0] = engine.speculator.stats.proposed_tokens if speculative else 0
            due.set()
            deadline = time.monotonic() + 30
            while not len(engine._commands) and time.monotonic() < deadline:  # until the update is queued
                time.sleep(0.001)

    try:
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), on_output)
        assert due.wait(60)
        assert llm.update_weights(update) == 1
        assert done.wait(60)
    finally:
        llm.shutdown()
    if speculative:
        proposed[1] = engine.speculator.stats.proposed_tokens
    completion = total[0].outputs[0]
    assert completion.weight_versions == observed  # each token tagged with the version that produced it
    return completion.token_ids, completion.weight_versions, proposed


def test_a_weight_update_between_verifications_gives_plain_decodings_tokens_and_versions(tmp_path: Path) -> None:
    """Weights change between steps, so a proposal is made and verified under one version: across an
    update (the running request keeping its KV), the tokens and their version tags equal plain
    decoding's given the same update after the same token, with verifications on both sides."""
    checkpoint = tmp_path / "tiny"
    save_tiny_checkpoint(checkpoint, "llama")
    update = weights_for(load_file(checkpoint / "model.safetensors"), 1)
    tokens, versions, (before, after) = generate_across_an_update(checkpoint, True, 8, update)
    switch = versions.index(1)
    assert len(tokens) == 40 and 8 <= switch < 30 and versions == [0] * switch + [1] * (40 - switch)
    assert 0 < before < after  # proposals verified before and after the update
    plain_tokens, plain_versions, _ = generate_across_an_update(checkpoint, False, switch, update)
    assert plain_versions == versions
    assert plain_tokens == tokens
    unchanged = make_llm(False, model=str(checkpoint))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        assert run(unchanged, PROMPTS[:1], params)[0][0][switch:] != tokens[switch:]  # the update did change them
    finally:
        unchanged.shutdown()


FAMILY_SETTINGS = {
    "llama": {},
    "mistral": dict(sliding_window=6),  # shorter than the prompts: verification rows see their own windows
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    **MOE_FAMILIES,
    **GEMMA_FAMILIES,
}


@pytest.fixture(scope="module", params=sorted(FAMILY_SETTINGS))
def family_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"spec-{request.param}")
    save_tiny_checkpoint(path, request.param, **FAMILY_SETTINGS[request.param])
    return path


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_family_on_each_backend_gives_plain_decodings_greedy_tokens(
    family_checkpoint: Path, backend: str
) -> None:
    """Each architecture (sliding windows, soft-capping, experts, q/k norms included) through the
    torch-native and the CPU backends: prompt lookup's greedy tokens are plain decoding's, with
    proposals accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = []
    for speculative in (False, True):
        llm = make_llm(speculative, model=str(family_checkpoint), attention_backend=backend)
        try:
            assert llm.engine.model.backend.name == backend
            outputs.append(run(llm, PROMPTS, params))
            if speculative:
                assert spec_stats(llm)["accepted_tokens"] > 0
        finally:
            llm.shutdown()
    assert outputs[1] == outputs[0]
