"""Faults injected into one step's forward, sampling and detokenization: the affected requests
end with an error, the others complete, the engine keeps serving, and the failures are counted.
A sampling failure of one sequence fails that sequence only, not the others of its step.

Injection is done by wrapping the live engine components in the test (no production flags), or
by corrupting the engine's own copy of a request's parameters after they were validated."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.request import RequestOutput, accumulate

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("faulty")
    save_tiny_checkpoint(path, "llama")
    engine = LLM(dtype="float32", model=str(path), num_kv_slots=2048)
    yield engine
    engine.shutdown()


def fail_once(obj: object, name: str, when=lambda *a, **k: True) -> list[int]:
    """Make ``obj.name`` raise the first time ``when(*args)`` holds; returns a hit counter."""
    original = getattr(obj, name)
    hits = [0]

    def wrapper(*args, **kwargs):
        if hits[0] == 0 and when(*args, **kwargs):
            hits[0] += 1
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return hits


def assert_pool_at_baseline(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["running"] == stats["waiting"] == stats["active_requests"] == 0
    assert stats["kv_capacity_pages"] - stats["kv_free_pages"] == stats["kv_cached_pages"]
    assert stats["free_rows"] == llm.engine.config.max_running_requests


def test_fault_in_a_forward_fails_that_step_only(llm: LLM) -> None:
    engine = llm.engine
    target, component = engine.executor, "execute"
    baseline = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    failed_before = engine.stats()["failed_requests"]
    # fail the step that decodes the long request's 4th token, whoever else is in it
    hits = fail_once(target, component, lambda *a, **k: _decoding_at(engine, 4))
    try:
        outs = llm.generate(
            [[5, 6, 7], [8, 9]],
            [GREEDY, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)],
            use_tqdm=False,
        )
    finally:
        delattr(target, component)
    assert hits[0] == 1
    assert outs[0].outputs[0].finish_reason == "error"
    assert "injected fault" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length"  # finished before the fault
    assert engine.is_healthy()
    assert engine.stats()["failed_requests"] == failed_before + 1
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline
    assert_pool_at_baseline(llm)


def _decoding_at(engine, n_out: int) -> bool:
    return any(len(s.output_token_ids) == n_out - 1 for s in engine.scheduler.running)


def test_fault_in_detokenization_fails_only_that_request(llm: LLM) -> None:
    from tokenmill.engine import detokenizer

    cls = detokenizer.IncrementalDetokenizer
    original = cls.add_token
    poisoned = 42

    def add_token(self, token_id: int) -> None:
        if token_id == poisoned:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        original(self, token_id)

    cls.add_token = add_token
    try:
        outs = llm.generate(
            [[5, 6], [7, 8]],
            [
                SamplingParams(max_tokens=3, temperature=0.5, logit_bias={poisoned: 100.0}),
                SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
            ],
            use_tqdm=False,
        )
    finally:
        cls.add_token = original
    assert outs[0].outputs[0].finish_reason == "error" and "injected fault" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 5
    assert llm.engine.is_healthy()
    assert_pool_at_baseline(llm)


def test_dead_loop_is_visible_and_calls_fail_fast(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path, "llama")
    llm = LLM(dtype="float32", model=str(tmp_path), num_kv_slots=512)
    engine = llm.engine

    def boom() -> None:
        raise SystemExit("injected: the loop itself dies")

    engine.pause_generation()
    waiting: list = []
    generating = threading.Thread(target=lambda: waiting.extend(llm.generate([[5, 6]], GREEDY, use_tqdm=False)))
    generating.start()
    while engine.stats()["active_requests"] == 0:
        generating.join(0.01)
    engine._commands.put(boom, lambda: None)  # a command that raises past the loop
    engine._thread.join(10)
    generating.join(60)
    assert not engine.is_healthy()
    assert waiting[0].outputs[0].finish_reason == "error" and "injected" in waiting[0].outputs[0].error
    from tokenmill.engine.engine import EngineDeadError

    with pytest.raises(EngineDeadError, match="loop is not running"):
        llm.generate(["hello"], use_tqdm=False)


def run_paused(llm: LLM, requests: list[tuple[list[int], SamplingParams]], corrupt=lambda states: None) -> list:
    """Submit ``requests`` while the engine is paused (so they share their first steps), let
    ``corrupt`` edit the engine's validated states, resume, and return each request's total output."""
    engine = llm.engine
    deltas: queue.Queue[RequestOutput] = queue.Queue()
    states = [engine.intake(prompt, params, deltas.put) for prompt, params in requests]
    corrupt(states)
    engine.pause_generation()
    try:
        for state in states:
            engine.submit(state)
    finally:
        engine.resume_generation()
    totals: dict[str, RequestOutput] = {}
    while sum(out.finished for out in totals.values()) < len(states):
        delta = deltas.get(timeout=60)
        totals[delta.request_id] = accumulate(totals.get(delta.request_id), delta)
    return [totals[state.request_id].outputs[0] for state in states]


def test_a_sampling_failure_fails_only_its_sequence(llm: LLM) -> None:
    seeded = ([5, 6, 7], SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))
    broken = ([8, 9], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1))
    greedy = ([4, 5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
    alone = [run_paused(llm, [request])[0] for request in (seeded, greedy)]
    vocab = llm.engine.model_config.vocab_size

    def corrupt(states) -> None:  # more logprobs than the vocabulary: the sampler's top-k raises
        states[1].params.logprobs = vocab + 50

    # the seeded request draws its token before the batch fails: the retry must draw the same one
    outs = run_paused(llm, [seeded, broken, greedy], corrupt)
    for out, reference in zip([outs[0], outs[2]], alone):
        assert out.finish_reason == "length" and out.error is None
        assert out.token_ids == reference.token_ids
    assert [list(lp) for lp in outs[2].logprobs] == [list(lp) for lp in alone[1].logprobs]
    assert outs[1].finish_reason == "error" and "internal error in sampling" in outs[1].error
    assert outs[1].token_ids == []
    assert llm.engine.is_healthy()
    assert_pool_at_baseline(llm)


def test_changing_params_after_submit_changes_nothing(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[], logit_bias={})
    free = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids

    def change_callers_params(states) -> None:  # runs before the submit; the change below runs after it
        states[0].callback = _mutating(states[0].callback, params, free)

    out = run_paused(llm, [([5, 6, 7], params)], change_callers_params)[0]
    assert out.token_ids == free


def _mutating(callback, params: SamplingParams, free: list[int]):
    """``callback``, after which the first delta changes the caller's ``params`` (submitted by then)."""

    def changed(delta: RequestOutput) -> None:
        callback(delta)
        if params.max_tokens != 4:
            params.stop_token_ids.append(free[2])  # would stop after three tokens if the engine read it
            params.logit_bias[free[3]] = -100.0
            params.max_tokens = 4

    return changed


def submit_together(engine, request_id: str, n_threads: int) -> list[str]:
    """``n_threads`` threads, released by one barrier, each add a request with ``request_id``;
    returns each one's outcome ("accepted" or its ValueError's message)."""
    barrier = threading.Barrier(n_threads)
    outcomes: list[str] = []
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def submit() -> None:
        barrier.wait()
        try:
            engine.add_request([5, 6], params, lambda _: None, request_id)
            outcomes.append("accepted")
        except ValueError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=submit) for _ in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


def test_concurrent_submits_of_one_request_id_accept_exactly_one(llm: LLM) -> None:
    engine = llm.engine
    engine.pause_generation()  # the accepted request stays live until the round aborts it
    try:
        for round_ in range(100):
            request_id = f"twin-{round_}"
            outcomes = submit_together(engine, request_id, 4)
            assert sorted(outcomes) == ["accepted"] + [f"request_id {request_id!r} is already in use"] * 3
            engine.abort(request_id)
    finally:
        engine.resume_generation()
    assert_pool_at_baseline(llm)
