"""The engine's CPU threads: fitted to the CPUs the load beside it leaves free. The load meter is measured
for real (relative to a baseline, so the tests hold beside any other load); the governor's and the
engine's decisions run on synthetic samples."""

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
from tokenmill.cpu_load import ForeignLoad, thread_cpu_seconds
from tokenmill.engine import thread_governor
from tokenmill.engine.thread_governor import ThreadGovernor, engine_thread_governor, threads_for
from tokenmill.hardware import usable_cpus


@contextmanager
def busy_neighbour(niceness: int = 0) -> Iterator[int]:
    """One process spinning on the CPU at ``nice`` +``niceness`` (its pid), stopped on exit."""
    spin = f"import os\nos.nice({niceness})\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # started and spinning
        yield proc.pid
    finally:
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


def cpu_share(seconds_used: Callable[[], float], window_s: float) -> float:
    """CPUs' worth ``seconds_used`` (a CPU-time counter) grows by over ``window_s`` of sleep."""
    start = seconds_used()
    time.sleep(window_s)
    return (seconds_used() - start) / window_s


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used (utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_foreign_load_counts_neighbours_and_own_other_threads_not_the_engines() -> None:
    """Measured for real, so every figure is relative to what the machine does anyway (a baseline
    taken the same way just before) or to the CPU time the neighbour itself used: the test holds
    beside any other load, a saturated machine included."""
    load = ForeignLoad(threading.current_thread())  # this thread plays the engine's loop thread

    def foreign_over(window_s: float, work: Callable[[], None] = lambda: None) -> float:
        load.sample()
        started = time.monotonic()
        while time.monotonic() - started < window_s:
            work()
        return load.sample()

    baseline = foreign_over(0.6, lambda: time.sleep(0.01))
    busy_engine = foreign_over(0.6)  # the "engine" spins: its own time is not foreign
    assert busy_engine < baseline + 0.4, (busy_engine, baseline)
    with busy_neighbour() as pid:  # a neighbour counts: at least the CPU time it got
        load.sample()
        share = cpu_share(lambda: process_cpu_seconds(pid), 0.6)
        assert share > 0.2 and load.sample() > share - 0.2, share
    baseline = foreign_over(0.6, lambda: time.sleep(0.01))
    with busy_neighbour(niceness=10):  # lower priority than the engine's: it yields, not foreign
        niced = foreign_over(0.6, lambda: time.sleep(0.01))
    assert niced < baseline + 0.3, (niced, baseline)
    load.sample()
    load.pause()
    with busy_neighbour():  # beside a paused meter: not counted, nor is the time
        time.sleep(0.6)
    load.resume()
    time.sleep(0.3)
    assert load.sample() < baseline + 0.4
    stop = threading.Event()

    def spin() -> None:  # another thread of this process: the server's threads count as foreign
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        assert spinner.native_id is not None
        load.sample()
        share = cpu_share(lambda: thread_cpu_seconds(spinner.native_id), 0.6)
        assert share > 0.2 and load.sample() > share - 0.2, share
    finally:
        stop.set()
        spinner.join()


class DialledLoad:
    """A load meter reading the foreign load off a dial the test turns (the engine's decisions on
    synthetic samples: the real measurement is the test above's)."""

    dial = 0.0

    def __init__(self, engine_thread: threading.Thread) -> None:
        self.engine_thread = engine_thread

    def sample(self) -> float:
        return DialledLoad.dial

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


def test_engine_gives_up_threads_to_neighbours_and_takes_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long generation runs while the load beside it rises to every usable CPU: the engine's
    threads drop below the usable CPUs between its steps; once the load is gone, it takes them back."""
    usable = usable_cpus()
    if usable < 2:
        pytest.skip("one usable CPU: there is no thread to give up")
    monkeypatch.setattr(thread_governor, "ForeignLoad", DialledLoad)
    DialledLoad.dial = 0.0
    save_tiny_checkpoint(tmp_path)
    llm = LLM(dtype="float32", model=str(tmp_path), num_kv_slots=4096)
    engine = llm.engine
    assert isinstance(engine.threads._load, DialledLoad)
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
        DialledLoad.dial = float(usable)
        assert threads_within(lambda n: n < usable, 10.0), "threads kept beside busy neighbours"
        DialledLoad.dial = 0.0
        assert threads_within(lambda n: n == usable, 10.0), "threads not taken back"
        assert engine.stats()["cpu_thread_changes"] >= 2
    finally:
        done.set()
        generating.join(30)
        llm.shutdown()
