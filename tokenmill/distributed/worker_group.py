"""Rank 0's side of tensor parallelism: it spawns the worker processes, joins their group, sends
each step's inputs and each call (a ``ModelWorker`` method every rank runs), keeps idle workers'
collectives from timing out, watches them, and stops them.

Workers are spawned (``torch.multiprocessing``'s spawn context, daemonic: the interpreter's exit
ends them too) by the process that builds the engine, unless ``torchrun`` started every rank
(``group.launched_place``): then this process is rank 0 and joins the others through torchrun's
environment, and the watchdog notices a lost worker by its failed collectives only. A script that
spawns workers must guard its top level with ``if __name__ == "__main__":`` as with any spawning
library. The group is
torch.distributed's default one, so a process runs one tensor-parallel engine at a time.

Every collective of the group is issued under :attr:`WorkerGroup.lock`, so the watchdog thread's
heartbeats never interleave with a step (the engine thread's message and forward). The watchdog
sends a heartbeat when no message went out for a third of the timeout (an idle worker waits in a
broadcast, which would time out otherwise; a hung worker makes it time out, so it is found while
idle too) and notes a worker that exited; any failed or timed-out collective is noted too. After a
failure (:attr:`failure`) every step raises: the engine fails its requests and reports itself
unhealthy, and :meth:`shutdown` kills what is left (a stopped worker too).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.config import EngineConfig, Resolved
from tokenmill.distributed import group, messages
from tokenmill.distributed.worker_process import RankError, agree_on_slots, worker_main
from tokenmill.model.loader import check_shardable
from tokenmill.model.parallel import TensorParallel
from tokenmill.worker.forward_step import ForwardStep

logger = logging.getLogger("tokenmill.distributed")
JOIN_TIMEOUT = 10.0
"""Seconds a worker gets to exit after the shutdown message before it is killed."""
EXIT_GRACE = 2.0
"""Seconds a failed collective waits for a worker's exit to show, so the failure names the dead worker."""


def spawn_workers(config: EngineConfig, port: int) -> list[mp.Process]:
    """Worker processes for ranks ``1..tensor_parallel_size-1`` (not started), to join rank 0's store at ``port``."""
    size, context = config.tensor_parallel_size, mp.get_context("spawn")
    return [
        context.Process(
            target=worker_main,
            args=(rank, size, port, config),
            name=f"tokenmill-tp-worker-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]


def start_worker_group(config: EngineConfig, resolved: Resolved) -> WorkerGroup | None:
    """The workers of ``config.tensor_parallel_size`` > 1 ranks, started and joined with rank 0 on
    ``resolved.device``, once the checkpoint is known to shard that way; None at size 1."""
    if config.tensor_parallel_size == 1:
        return None
    check_shardable(resolved.model_path, TensorParallel(config.tensor_parallel_size))  # before any worker starts
    return WorkerGroup(config, group.rank_device(resolved.device, 0), config.distributed_timeout_s)


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
        size, place = config.tensor_parallel_size, group.launched_place()
        if place is not None:
            group.check_launched_size(place, size)
            if place.rank != 0:
                raise RuntimeError(f"rank {place.rank} of a torchrun launch is a worker: only rank 0 runs an engine")
        self.device = device
        self.timeout = timeout
        self.lock = threading.Lock()
        self.failure: str | None = None
        store = group.host_store(size, timeout) if place is None else None  # None: torchrun's (env://)
        self.processes = [] if store is None else spawn_workers(config, store.port)
        for process in self.processes:
            process.start()
        self._threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(group.cpu_threads_per_rank(size if place is None else place.local_size))
        try:
            self.tp: TensorParallel = group.join(0, size, device, timeout, store)
        except BaseException:
            self._stop_processes(grace=0.0)
            torch.set_num_threads(self._threads)
            raise
        self._serving = False  # set once the ranks agreed on the KV size: workers then wait for messages
        self._last_message = time.monotonic()
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tokenmill-tp-watchdog", daemon=True)

    def agree_on_slots(self, n_slots: int) -> int:
        """The KV slot count every rank can hold (the smallest); starts the watchdog once agreed."""
        with self._collective():
            n_slots = agree_on_slots(n_slots, self.device, self.timeout)
        self._serving = True
        self._watchdog.start()
        return n_slots

    @contextlib.contextmanager
    def step(self, step: ForwardStep) -> Iterator[None]:
        """Send a step; the caller runs rank 0's forward of it inside (the workers run theirs)."""
        with self._collective():
            messages.send(messages.Kind.STEP, step, self.device)
            yield

    def call(self, method: str, args: tuple[Any, ...], local: Callable[[], Any]) -> list[Any]:
        """Have every worker run its ``ModelWorker``'s ``method(*args)`` while rank 0 runs ``local()``;
        every rank's result by rank (a worker's exception comes back as a :class:`RankError`). An
        exception of ``local`` is raised after the results are gathered (the workers wait for rank 0's
        part of the gather). A call that raised on some rank may have changed the others: the group
        counts as failed then (:attr:`failure`), as it would had that rank died. Call between steps."""
        with self._collective():
            messages.send_call(method, args, self.device)
            error: BaseException | None = None
            try:
                result = local()
            except BaseException as exc:
                error, result = exc, None
            results = messages.gather_results(result)
        faults = [f"rank 0: {type(error).__name__}: {error}"] if error is not None else []
        faults += [f"rank {r.rank}: {r.error}" for r in results if isinstance(r, RankError)]
        if faults:
            self.failure = f"tensor-parallel call {method} failed on " + "; ".join(faults)
            logger.error("%s", self.failure)
        if error is not None:
            raise error
        return results

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """Hold the group for collectives; raise :class:`WorkerGroupError` once it failed, and note a failure."""
        with self.lock:
            if self.failure is not None:
                raise WorkerGroupError(self.failure)
            try:
                yield
            except Exception as exc:
                self.failure = self._worker_exits(EXIT_GRACE) or f"a collective failed: {type(exc).__name__}: {exc}"
                raise WorkerGroupError(self.failure) from exc
            finally:
                self._last_message = time.monotonic()

    def _worker_exits(self, grace: float = 0.0) -> str | None:
        """The spawned workers that exited, with their exit codes (None: none did), after waiting up
        to ``grace`` seconds for one to: a killed worker's sockets (and its sentinel) close before
        it can be reaped, so a collective can fail while ``is_alive()`` still says True."""
        dead = [p for p in self.processes if not p.is_alive()]
        if not dead and self.processes and grace > 0:
            ready = multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout=grace)
            for process in self.processes:
                if process.sentinel in ready:  # every file of it is closed: it is exiting
                    process.join(grace)
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
            messages.send(messages.Kind.HEARTBEAT, device=self.device)
        except Exception as exc:
            self.failure = self._worker_exits(EXIT_GRACE) or f"a heartbeat failed: {type(exc).__name__}: {exc}"
            logger.error("%s", self.failure)
        self._last_message = time.monotonic()

    def shutdown(self) -> None:
        """Stop the workers (a shutdown message, then kill those still alive) and leave the group.
        Workers still starting (rank 0's build failed before the KV size agreement) wait in another
        collective, so they get no message: they are killed (spawned) or time out (torchrun)."""
        self._stopping.set()
        if self._watchdog.is_alive():
            self._watchdog.join()
        acquired = self.lock.acquire(timeout=self.timeout)
        try:
            told = self.failure is None and acquired and self._serving
            if told:
                with contextlib.suppress(Exception):
                    messages.send(messages.Kind.SHUTDOWN, device=self.device)
            self._stop_processes(JOIN_TIMEOUT if told else 0.0)
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
