"""Speculative decoding with a draft model: the target's output exactly (greedy and seeded), the
draft's KV kept in step with the accepted tokens, and drafts that do not fit the target refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.test_siblings import pages_held_only_by_the_prefix_cache
from tests.tiny_models import save_tiny_checkpoint
from tests.tiny_tokenizer import save_tiny_tokenizer
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], list(range(20, 60)) + list(range(20, 30))]
ENGINE = {"dtype": "float32", "num_kv_slots": 2048}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-layer target, and as drafts: its first layer alone (agrees with it on some tokens), a
    random model, a model of another vocabulary and one of a shorter context."""
    root = tmp_path_factory.mktemp("draft")
    target = save_tiny_checkpoint(root / "target", "llama", seed=0, num_hidden_layers=4)
    target.model.layers = target.model.layers[:1]
    target.config.num_hidden_layers = 1
    target.save_pretrained(root / "first-layer", safe_serialization=True)
    save_tiny_tokenizer(root / "first-layer", vocab_size=target.config.vocab_size)
    save_tiny_checkpoint(root / "random", "llama", seed=1, num_hidden_layers=1)
    save_tiny_checkpoint(root / "other-vocab", "llama", seed=1, num_hidden_layers=1, vocab_size=120)
    save_tiny_checkpoint(root / "short", "llama", seed=1, num_hidden_layers=1, max_position_embeddings=64)
    return {name: root / name for name in ("target", "first-layer", "random", "other-vocab", "short")}


def draft_setting(draft: Path, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "disable_by_batch_size": 100}


@pytest.fixture(scope="module")
def plain(models: dict[str, Path]) -> Iterator[LLM]:
    llm = LLM(model=str(models["target"]), **ENGINE)
    yield llm
    llm.shutdown()


def run(llm: LLM, prompts: list, params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


def test_the_target_as_its_own_draft_has_every_proposal_accepted(models: dict[str, Path], plain: LLM) -> None:
    """A draft that is the target proposes the target's greedy tokens, so every proposal is
    accepted: true only while the draft's KV holds exactly the sequence's tokens, step after step,
    for several sequences at once."""
    llm = LLM(model=str(models["target"]), speculative_config=draft_setting(models["target"]), **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        assert run(llm, PROMPTS, params) == run(plain, PROMPTS, params)
        stats = llm.engine.stats()["speculative"]
        assert stats["method"] == "draft_model"
        assert stats["proposed_tokens"] >= 3 * 30 // 2 and stats["accepted_tokens"] == stats["proposed_tokens"]
        assert llm.engine.stats()["scheduler"]["steps"] < 30
    finally:
        llm.shutdown()


def test_each_proposal_is_the_drafts_greedy_continuation(models: dict[str, Path]) -> None:
    """With a draft that is often rejected, every proposal is still the draft model's own greedy
    continuation of the sequence's tokens at that step (the oracle: the draft run plainly): its KV
    follows the accepted tokens and drops the rejected ones."""
    llm = LLM(model=str(models["target"]), speculative_config=draft_setting(models["first-layer"]), **ENGINE)
    proposer = llm.engine.speculator.proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(seq, k):  # noqa: ANN001, ANN202 - a spy on the engine thread
        proposal = propose(seq, k)
        seen.append((list(seq.all_token_ids), proposal))
        return proposal

    proposer.propose = recording
    try:
        run(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        stats = llm.engine.stats()["speculative"]
    finally:
        llm.shutdown()
    assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
    draft = LLM(model=str(models["first-layer"]), **ENGINE)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=len(p), ignore_eos=True) for _, p in seen]
        continuations = draft.generate([{"prompt_token_ids": t} for t, _ in seen], params, use_tqdm=False)
    finally:
        draft.shutdown()
    assert [c.outputs[0].token_ids for c in continuations] == [p for _, p in seen]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2, seed=1),
        SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7, top_k=5),
        SamplingParams(temperature=0.0, max_tokens=24, stop=["e"]),
    ],
    ids=["greedy-logprobs", "n2", "seeded", "stop-string"],
)
@pytest.mark.parametrize("draft", ["first-layer", "random"])
def test_a_draft_gives_the_targets_output(models: dict[str, Path], plain: LLM, draft: str, params) -> None:
    llm = LLM(model=str(models["target"]), speculative_config=draft_setting(models[draft]), **ENGINE)
    try:
        ours = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.engine.stats()["speculative"]
        assert pages_held_only_by_the_prefix_cache(llm)
    finally:
        llm.shutdown()
    theirs = plain.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ours, theirs):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            for mine, yours in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert {t: round(lp.logprob, 4) for t, lp in mine.items()} == pytest.approx(
                    {t: round(lp.logprob, 4) for t, lp in yours.items()}, abs=2e-4
                )
    assert stats["proposed_tokens"] > 0
    if draft == "first-layer" and params.temperature == 0.0 and params.stop is None:
        assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"]


def test_greedy_output_holds_under_preemption_and_chunked_prefill(models: dict[str, Path], plain: LLM) -> None:
    prompts = [PROMPTS[i % 3][: 8 + i] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = dict(ENGINE, page_size=4, num_kv_slots=96, max_running_requests=4, max_num_batched_tokens=16)
    llm = LLM(model=str(models["target"]), speculative_config=draft_setting(models["first-layer"]), **options)
    try:
        assert run(llm, prompts, params) == run(plain, prompts, params)
        assert llm.engine.stats()["scheduler"]["preemptions"] > 0
        assert llm.engine.stats()["speculative"]["accepted_tokens"] > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "draft, options, message",
    [
        ("other-vocab", {}, "another vocabulary than the target"),
        ("short", {}, r"the draft model's context \(64 tokens\) is shorter than the target's \(256\)"),
        ("random", {"tensor_parallel_size": 2}, "not supported with tensor parallelism"),
    ],
)
def test_a_draft_that_does_not_fit_the_target_is_refused_at_start(
    models: dict[str, Path], draft: str, options: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model=str(models["target"]), speculative_config=draft_setting(models[draft]), **ENGINE, **options)


def test_the_server_command_refuses_a_draft_of_another_vocabulary_with_its_message(models: dict[str, Path]) -> None:
    """``tokenmill serve`` ends before serving, as with a bad flag: the reason on stderr, exit 2."""
    setting = json.dumps(draft_setting(models["other-vocab"]))
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(models["target"]), "--dtype", "float32"]
    done = subprocess.run(
        [*command, "--port", "0", "--speculative-config", setting], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert "tokenmill: error: speculative_config: the draft model" in done.stderr
    assert "another vocabulary than the target" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, "'model' .* goes with method 'draft_model' only"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "goes with method 'draft_model' only"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": ""}, "must be a checkpoint path"),
    ],
)
def test_bad_draft_settings_are_refused(setting: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(dtype="float32", speculative_config=setting)


def test_a_draft_that_is_always_rejected_backs_off(models: dict[str, Path], plain: LLM) -> None:
    """The random draft's proposals are all rejected here: after each wholly rejected proposal the
    sequence goes 2, 4, 8, ... steps without one, so 60 tokens see a handful of proposals, not one
    per step, and the output is still the target's."""
    llm = LLM(model=str(models["target"]), speculative_config=draft_setting(models["random"]), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    try:
        assert run(llm, PROMPTS[1:2], params) == run(plain, PROMPTS[1:2], params)
        stats = llm.engine.stats()["speculative"]
    finally:
        llm.shutdown()
    assert stats["accepted_tokens"] == 0, "the premise: this draft never agrees with the target"
    assert 0 < stats["verify_steps"] <= 6
