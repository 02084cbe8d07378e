"""Rank 0's side of tensor parallelism: it spawns the worker processes, joins their group, sends
each step's inputs, keeps idle workers' collectives from timing out, watches them, and stops them.

Workers are spawned (``torch.multiprocessing``'s spawn context, daemonic: the interpreter's exit
ends them too) by the process that builds the engine; a script that builds one must therefore
guard its top level with ``if __name__ == "__main__":`` as with any spawning library. The group is
torch.distributed's default one, so a process runs one tensor-parallel engine at a time.

Every collective of the group is issued under :attr:`WorkerGroup.lock`, so the watchdog thread's
heartbeats never interleave with a step (the engine thread's message and forward). The watchdog
sends a heartbeat when no message went out for a third of the timeout (an idle worker waits in a
broadcast, which would time out otherwise) and notes a worker that exited; any failed or timed-out
collective is noted too. After a failure (:attr:`failure`) every step raises: the engine fails its
requests and reports itself unhealthy, and :meth:`shutdown` kills what is left.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.config import EngineConfig
from tokenmill.distributed import group, step
from tokenmill.distributed.worker import agree_on_slots, worker_main
from tokenmill.model.parallel import TensorParallel

logger = logging.getLogger("tokenmill.distributed")
JOIN_TIMEOUT = 10.0
"""Seconds a worker gets to exit after the shutdown message before it is killed."""


class WorkerGroupError(RuntimeError):
    """A worker died, or a collective failed or timed out: the group cannot run steps any more."""


class WorkerGroup:
    """The workers of a ``config.tensor_parallel_size`` group and rank 0's membership (:attr:`tp`)."""

    def __init__(self, config: EngineConfig, device: torch.device, timeout: float) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group (another engine with "
                "tensor_parallel_size > 1 runs here): shut it down first; one tensor-parallel engine per process"
            )
        size = config.tensor_parallel_size
        self.device = device
        self.timeout = timeout
        self.lock = threading.Lock()
        self.failure: str | None = None
        store = group.host_store(size, timeout)
        context = mp.get_context("spawn")
        self.processes = [
            context.Process(
                target=worker_main,
                args=(rank, size, store.port, config, timeout),
                name=f"tokenmill-tp-worker-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        self._threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(group.cpu_threads_per_rank(size))
        try:
            self.tp: TensorParallel = group.join(0, size, device, timeout, store)
        except BaseException:
            self._stop_processes(grace=0.0)
            raise
        self._last_message = time.monotonic()
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tokenmill-tp-watchdog", daemon=True)

    def agree_on_slots(self, n_slots: int) -> int:
        """The KV slot count every rank can hold (the smallest); starts the watchdog once agreed."""
        with self._collective():
            n_slots = agree_on_slots(n_slots, self.device)
        self._watchdog.start()
        return n_slots

    @contextlib.contextmanager
    def step(self, inputs: step.StepInputs) -> Iterator[None]:
        """Send a step's inputs; the caller runs rank 0's forward inside (the workers run theirs)."""
        with self._collective():
            step.send(step.Kind.STEP, inputs, self.device)
            yield

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """Hold the group for collectives; raise :class:`WorkerGroupError` once it failed, and note a failure."""
        with self.lock:
            if self.failure is not None:
                raise WorkerGroupError(self.failure)
            try:
                yield
            except Exception as exc:
                self.failure = self._worker_exits() or f"a collective failed: {type(exc).__name__}: {exc}"
                raise WorkerGroupError(self.failure) from exc
            finally:
                self._last_message = time.monotonic()

    def _worker_exits(self) -> str | None:
        dead = [p for p in self.processes if not p.is_alive()]
        if not dead:
            return None
        return "; ".join(f"tensor-parallel worker {p.name} exited (code {p.exitcode})" for p in dead)

    def _watch(self) -> None:
        interval = self.timeout / 3
        while not self._stopping.wait(min(interval, 1.0)):
            exits = self._worker_exits()
            if exits is not None and self.failure is None:
                self.failure = exits
                logger.error("%s", exits)
            if self.failure is not None:
                return
            if time.monotonic() - self._last_message > interval and self.lock.acquire(blocking=False):
                try:
                    with contextlib.suppress(WorkerGroupError):
                        self._heartbeat()
                finally:
                    self.lock.release()

    def _heartbeat(self) -> None:
        try:
            step.send(step.Kind.HEARTBEAT, device=self.device)
        except Exception as exc:
            self.failure = self._worker_exits() or f"a heartbeat failed: {type(exc).__name__}: {exc}"
            logger.error("%s", self.failure)
        self._last_message = time.monotonic()

    def shutdown(self) -> None:
        """Stop the workers (a shutdown message, then kill those still alive) and leave the group."""
        self._stopping.set()
        if self._watchdog.is_alive():
            self._watchdog.join()
        acquired = self.lock.acquire(timeout=self.timeout)
        try:
            if self.failure is None and acquired:
                with contextlib.suppress(Exception):
                    step.send(step.Kind.SHUTDOWN, device=self.device)
            self._stop_processes(JOIN_TIMEOUT if self.failure is None else 0.0)
            group.leave()
        finally:
            if acquired:
                self.lock.release()
            if self.device.type == "cpu":
                torch.set_num_threads(self._threads)

    def _stop_processes(self, grace: float = JOIN_TIMEOUT) -> None:
        deadline = time.monotonic() + grace
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
