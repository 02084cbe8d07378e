"""No caller of the Python API waits forever (issue 19).

When the engine shuts down, every caller still waiting is answered: ``LLM.generate`` returns
outputs ending with "abort", an ``AsyncEngine.generate`` stream ends with an "abort" delta, a
request queued but never admitted gets its final delta, a queued ``Engine.call`` (``stats``) raises
EngineDeadError, and so does every later submit. Ctrl-C inside ``LLM.generate`` aborts that batch.

Waits are bounded by ``HANG_GUARD_S`` so that a regression fails instead of hanging; it bounds a
hang, it does not measure speed.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineDeadError, EngineOverloadedError
from tokenmill.request import RequestOutput

HANG_GUARD_S = 60.0
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hung") / "tiny-llama"
    save_tiny_checkpoint(path, "llama")
    return path


@pytest.fixture
def llm(checkpoint: Path) -> Iterator[LLM]:
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=2048)
    yield llm
    llm.shutdown()


class Caller(threading.Thread):
    """Runs ``fn`` in a daemon thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def outcome(self) -> Any:
        self.join(HANG_GUARD_S)
        assert not self.is_alive(), "the caller is still waiting"
        return self.result


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def stream(engine: Engine, prompt: list[int]) -> list[RequestOutput]:
    """Every delta of one AsyncEngine stream, read to its end."""

    async def read() -> list[RequestOutput]:
        return [delta async for delta in AsyncEngine(engine).generate(prompt, LONG)]

    return asyncio.run(read())


def final_delta(deltas: queue.Queue[RequestOutput]) -> RequestOutput:
    while not (delta := deltas.get(timeout=HANG_GUARD_S)).finished:
        pass
    return delta


def test_shutdown_mid_step_answers_every_waiting_caller(llm: LLM) -> None:
    engine = llm.engine
    engine.pause_generation()
    generating = Caller(lambda: llm.generate([[5, 6, 7], [8, 9]], LONG, use_tqdm=False))
    streaming = Caller(lambda: stream(engine, [4, 5]))
    wait_until(lambda: engine.stats()["active_requests"] == 3)

    # hold the loop inside a step's forward while more callers queue up behind it
    forward, in_forward, release = engine.executor.execute, threading.Event(), threading.Event()

    def held_forward(step: Any) -> Any:
        in_forward.set()
        release.wait()
        return forward(step)

    engine.executor.execute = held_forward
    engine.resume_generation()
    assert in_forward.wait(HANG_GUARD_S)
    queued_add: queue.Queue[RequestOutput] = queue.Queue()
    engine.add_request([3, 4], LONG, queued_add.put)  # queued, never admitted
    stats = Caller(engine.stats)
    wait_until(lambda: len(engine._commands) == 2)  # the add and the stats call are queued
    stopping = Caller(engine.shutdown)
    wait_until(engine._stop.is_set)
    release.set()  # the step ends, then the loop stops

    outputs = generating.outcome()
    assert generating.error is None, generating.error
    assert [out.outputs[0].finish_reason for out in outputs] == ["abort", "abort"]
    assert all(out.finished and out.outputs[0].error is None for out in outputs)
    deltas = streaming.outcome()
    assert streaming.error is None, streaming.error
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "abort"
    never_admitted = final_delta(queued_add)
    assert never_admitted.outputs[0].finish_reason == "abort" and never_admitted.outputs[0].token_ids == []
    stats.outcome()
    assert isinstance(stats.error, EngineDeadError)
    stopping.outcome()
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError):
        engine.add_request([5, 6], LONG, lambda _: None)
    with pytest.raises(EngineDeadError):
        llm.generate([[5, 6]], LONG, use_tqdm=False)


def test_shutdown_of_a_paused_engine_ends_generate(llm: LLM) -> None:
    llm.engine.pause_generation()
    generating = Caller(lambda: llm.generate([[5, 6, 7]], LONG, use_tqdm=False))
    wait_until(lambda: llm.engine.stats()["active_requests"] == 1)
    llm.shutdown()
    outputs = generating.outcome()
    assert generating.error is None, generating.error
    assert outputs[0].outputs[0].finish_reason == "abort"


@pytest.mark.parametrize("round_", range(3))
def test_submits_racing_shutdown_are_answered_or_refused(checkpoint: Path, round_: int) -> None:
    """A submit either raises EngineDeadError or its request gets a final delta, never neither."""
    engine = Engine(dtype="float32", model=str(checkpoint), num_kv_slots=2048, max_waiting_requests=64)
    accepted: list[queue.Queue[RequestOutput]] = []

    def submit_until_refused() -> None:
        while True:
            deltas: queue.Queue[RequestOutput] = queue.Queue()
            try:
                engine.add_request([5, 6, 7], LONG, deltas.put)
            except EngineOverloadedError:  # the loop is behind: let it catch up
                time.sleep(0.001)
                continue
            except EngineDeadError:
                return
            accepted.append(deltas)

    submitters = [Caller(submit_until_refused) for _ in range(2)]
    wait_until(lambda: len(accepted) >= 5 + 10 * round_)  # shut down at a different moment each round
    engine.shutdown()
    for submitter in submitters:
        submitter.outcome()
        assert submitter.error is None, submitter.error
    assert all(final_delta(deltas).finished for deltas in accepted)


def test_ctrl_c_in_generate_aborts_its_requests(llm: LLM) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("only the main thread receives SIGINT")
    engine = llm.engine
    engine.pause_generation()  # the batch cannot finish before the interrupt
    main = threading.get_ident()

    def interrupt_when_submitted() -> None:
        wait_until(lambda: engine.stats()["active_requests"] == 3)
        signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupter = Caller(interrupt_when_submitted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7], [8, 9], [4]], LONG, use_tqdm=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    interrupter.outcome()
    stats = engine.stats()  # taken after the aborts, which were queued first
    assert stats["active_requests"] == stats["waiting"] == stats["running"] == 0
    engine.resume_generation()
    out = llm.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3
