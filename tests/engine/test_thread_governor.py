"""The engine's CPU threads: fitted to the CPUs the load beside it leaves free, measured for real."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.cpu_load import ForeignLoad
from tokenmill.engine.thread_governor import ThreadGovernor, engine_thread_governor, threads_for
from tokenmill.hardware import usable_cpus


@contextmanager
def busy_processes(n: int, niceness: int = 0) -> Iterator[None]:
    """``n`` processes spinning on the CPU (neighbours) at ``nice`` +``niceness``, stopped on exit."""
    spin = f"import os\nos.nice({niceness})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        time.sleep(0.3)  # started and spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("usable", "foreign", "threads"),
    [(2, 0.0, 2), (2, 0.2, 2), (2, 0.3, 1), (2, 0.67, 1), (2, 1.9, 1), (16, 3.0, 13), (16, 3.3, 12), (1, 4.0, 1)],
)
def test_threads_for_the_load(usable: int, foreign: float, threads: int) -> None:
    assert threads_for(usable, foreign) == threads


class ScriptedLoad:
    """A load meter that returns scripted samples and records pauses and resumes."""

    def __init__(self, loads: list[float | None]) -> None:
        self.loads = loads
        self.events: list[str] = []

    def sample(self) -> float | None:
        return self.loads.pop(0)

    def pause(self) -> None:
        self.events.append("pause")

    def resume(self) -> None:
        self.events.append("resume")


def test_governor_drops_at_once_and_adds_back_after_two_samples() -> None:
    clock, load, applied = [0.0], ScriptedLoad([None, 0.7, 0.7, 0.0, 0.9, 0.0, 0.0]), []
    loads = load.loads
    governor = ThreadGovernor(2, load, 0.5, lambda: clock[0], applied.append)
    assert applied == [2] and governor.threads == 2
    expected = [2, 1, 1, 1, 1, 1, 2]  # None measures nothing; 0.0 once is not enough to add a thread back
    for threads in expected:
        governor.tick()
        governor.tick()  # within the interval: no sample
        assert governor.threads == threads
        clock[0] += 0.5
    assert applied == [2, 1, 2] and governor.changes == 2 and not loads


def test_one_long_step_of_low_load_is_enough_to_add_threads_back() -> None:
    clock, load, applied = [0.0], ScriptedLoad([None, 0.9, 0.0, 0.0, 0.0]), []
    governor = ThreadGovernor(2, load, 0.5, lambda: clock[0], applied.append)
    for at, threads in [(0.5, 1), (1.0, 1), (1.5, 2)]:  # low load over 0.5 s, then 0.5 s more: two samples
        clock[0] = at
        governor.tick()
        assert governor.threads == threads
    load.loads[:0] = [0.9]
    clock[0] = 2.0
    governor.tick()
    assert governor.threads == 1
    clock[0] = 3.2  # one step of 1.2 s at low load: evidence enough
    governor.tick()
    assert governor.threads == 2 and applied == [2, 1, 2, 1, 2]


def test_a_rest_pauses_the_sampling_window_and_its_clock() -> None:
    clock, load, applied = [0.0], ScriptedLoad([None, 0.9]), []
    governor = ThreadGovernor(2, load, 0.5, lambda: clock[0], applied.append)
    governor.tick()  # the window opens at 0.0; the next sample is due at 0.5
    clock[0] = 0.2
    governor.rest()
    clock[0] = 9.0
    governor.rest()  # still resting: the rest began at 0.2
    clock[0] = 10.0
    governor.tick()  # 9.8 s of rest: the next sample is due at 10.3, after 0.3 s more of work
    assert load.events == ["pause", "resume"] and governor.threads == 2 and load.loads == [0.9]
    clock[0] = 10.3
    governor.tick()
    assert governor.threads == 1 and applied == [2, 1] and not load.loads


def test_fixed_threads_and_no_governor_off_cpu_or_at_tp() -> None:
    def run(config: EngineConfig, device: str) -> tuple[ThreadGovernor | None, int]:
        result = []  # on a thread of its own: the thread count is the calling thread's
        thread = threading.Thread(
            target=lambda: result.append(
                (
                    engine_thread_governor(config, torch.device(device), threading.current_thread()),
                    torch.get_num_threads(),
                )
            )
        )
        thread.start()
        thread.join()
        return result[0]

    governor, threads = run(EngineConfig(cpu_threads=0), "cpu")
    assert isinstance(governor, ThreadGovernor) and governor.usable == usable_cpus() == threads
    assert run(EngineConfig(cpu_threads=1), "cpu") == (None, 1)
    assert run(EngineConfig(cpu_threads=0), "meta")[0] is None
    assert run(EngineConfig(cpu_threads=0, tensor_parallel_size=2), "cpu")[0] is None
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=-1)


def test_usable_cpus_follow_affinity_and_cgroup_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no cgroup file: the affinity mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1  # half a CPU of quota: one thread
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{100000 * (affinity + 3)}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == affinity  # a quota above the mask does not add CPUs


def test_foreign_load_counts_neighbours_and_own_other_threads_not_the_engines() -> None:
    load = ForeignLoad(threading.current_thread())  # this thread plays the engine's loop thread
    load.sample()
    started = time.monotonic()
    while time.monotonic() - started < 0.6:  # the "engine" is busy: not foreign
        pass
    assert load.sample() < 0.5
    with busy_processes(1):
        load.sample()
        time.sleep(0.6)
        assert load.sample() > 0.6
    with busy_processes(1, niceness=10):  # lower priority than the engine's: it yields, not foreign
        load.sample()
        time.sleep(0.6)
        assert load.sample() < 0.3
    stop = threading.Event()

    def spin() -> None:  # another thread of this process: the server's threads count as foreign
        while not stop.is_set():
            pass

    load.sample()
    load.pause()
    with busy_processes(1):  # beside a paused meter: not counted, nor is the time
        time.sleep(0.6)
    load.resume()
    time.sleep(0.3)
    assert load.sample() < 0.5
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        load.sample()
        time.sleep(0.6)
        assert load.sample() > 0.6
    finally:
        stop.set()
        spinner.join()


def test_engine_gives_up_threads_to_neighbours_and_takes_them_back(tmp_path: Path) -> None:
    """A long generation runs while ``usable_cpus()`` busy processes share the machine: the engine's
    threads drop below the usable CPUs; once they stop, the engine takes its threads back."""
    usable = usable_cpus()
    if usable < 2:
        pytest.skip("one usable CPU: there is no thread to give up")
    save_tiny_checkpoint(tmp_path)
    llm = LLM(dtype="float32", model=str(tmp_path), num_kv_slots=4096)
    engine = llm.engine
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    done = threading.Event()

    def generate_until_done() -> None:  # the engine steps all along
        while not done.is_set():
            llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)

    generating = threading.Thread(target=generate_until_done)

    def threads_within(predicate: Callable[[int], bool], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if predicate(engine.stats()["cpu_threads"]):
                return True
            time.sleep(0.1)
        return False

    try:
        assert engine.stats()["cpu_threads"] == usable
        generating.start()
        with busy_processes(usable):
            assert threads_within(lambda n: n < usable, 10.0), "threads kept beside busy neighbours"
        assert threads_within(lambda n: n == usable, 10.0), "threads not taken back"
        assert engine.stats()["cpu_thread_changes"] >= 2
    finally:
        done.set()
        generating.join(30)
        llm.shutdown()
