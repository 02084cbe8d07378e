"""Faults injected into one step's forward, sampling and detokenization: the affected requests
end with an error, the others complete, the engine keeps serving, and the failures are counted.

Injection is done by wrapping the live engine components in the test (no production flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams

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


@pytest.mark.parametrize("component", ["forward", "sample"])
def test_fault_in_a_step_fails_that_step_only(llm: LLM, component: str) -> None:
    engine = llm.engine
    target = engine.runner if component == "forward" else engine.sampler
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

    engine._commands.put(boom)
    engine._thread.join(10)
    assert not engine.is_healthy()
    from tokenmill.engine.engine import EngineDeadError

    with pytest.raises(EngineDeadError, match="loop is not running"):
        llm.generate(["hello"], use_tqdm=False)
