"""A tensor-parallel worker process (ranks 1..N-1): it builds this rank's model worker (its shards
of the model, its KV storage for its heads, a replica of the request-to-token table) and executes
rank 0's steps and calls.

The process holds no scheduler, request table or sampler: each step comes from rank 0
(``messages.py``) and runs through the same ``ModelWorker.execute`` as rank 0's, taking part in
every collective of the forward; rank 0 alone uses the logits. It ends on rank 0's shutdown
message, or when a collective fails or times out (rank 0 died or hung), so a worker never
outlives its engine for longer than the collective timeout.

A worker process ends with ``os._exit`` once it has left the group, skipping the interpreter's
finalization: gloo's work threads may still be dropping a finished collective's last tensor
reference, which takes the GIL, and a thread that needs the GIL while the interpreter finalizes
aborts the whole process (``std::terminate``; seen at exit under load).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch

from tokenmill.config import EngineConfig
from tokenmill.cpu_memory import keep_freed_memory
from tokenmill.distributed import group, messages
from tokenmill.model.parallel import TensorParallel
from tokenmill.model.registry import resolve_config
from tokenmill.worker.model_worker import build_model_worker

logger = logging.getLogger("tokenmill.distributed")


def worker_main(rank: int, size: int, port: int, config: EngineConfig) -> None:
    """Entry point of a spawned worker process: join rank 0's group, build, serve steps until told to stop."""
    logging.basicConfig(level=logging.WARNING)
    store = torch.distributed.TCPStore("127.0.0.1", port, size, is_master=False)
    run(config, rank, size, group.rank_device(config.resolved_device(), rank), size, store)
    exit_process()


def launched_worker_main(config: EngineConfig) -> NoReturn:
    """Entry point of a worker that ``torchrun`` started (a rank above 0; rank 0 runs the engine):
    join the group through torchrun's environment, build, serve steps until rank 0 tells it to stop
    or is gone, then exit the process (status 0). SIGINT and SIGTERM are ignored: rank 0 receives
    them too (a Ctrl-C in torchrun's terminal, or torchrun stopping), drains its server and then
    stops the workers."""
    place = group.launched_place()
    if place is None or place.rank == 0:
        raise RuntimeError("a torchrun-launched worker needs torchrun's environment and a rank above 0")
    group.check_launched_size(place, config.tensor_parallel_size)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    device = group.rank_device(config.resolved_device(), place.local_rank)
    run(config, place.rank, place.size, device, place.local_size)
    exit_process()


def exit_process() -> NoReturn:
    """End this worker process with status 0 without finalizing the interpreter (module docstring),
    its logs and output flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(
    config: EngineConfig,
    rank: int,
    size: int,
    device: torch.device,
    local_size: int,
    store: torch.distributed.Store | None = None,
) -> None:
    """Join the group as ``rank`` (through ``store``, or torchrun's environment when None), build this
    rank, serve steps until told to stop, leave. ``local_size``: the ranks sharing this machine's CPUs."""
    if device.type == "cpu":
        torch.set_num_threads(group.cpu_threads_per_rank(local_size))
        if config.cpu_keep_freed_memory:
            keep_freed_memory()
    timeout = config.distributed_timeout_s
    tp = group.join(rank, size, device, timeout, store)
    try:
        serve(config, tp, device, timeout)
    except Exception:  # rank 0 is gone or hung (its side reports it); nothing to answer here
        logger.exception("tensor-parallel worker %d stopped", rank)
    finally:
        group.leave()


@dataclass(frozen=True)
class RankError:
    """What a worker's call raised, as its result (the call goes on on the other ranks)."""

    rank: int
    error: str


def serve(config: EngineConfig, tp: TensorParallel, device: torch.device, timeout: float) -> None:
    """Build this rank's worker (agreeing on the KV size with the others), run messages until shutdown."""
    resolved = dataclasses.replace(resolve_config(config)[0], device=device)
    worker = build_model_worker(config, resolved, tp, agree_on_slots=lambda n: agree_on_slots(n, device, timeout))
    while True:
        kind, step = messages.receive(device)
        if kind == messages.Kind.SHUTDOWN:
            return
        if kind == messages.Kind.STEP:
            assert step is not None
            worker.execute(step)
        elif kind == messages.Kind.CALL:
            method, args = messages.receive_call(device)
            try:
                result = getattr(worker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - rank 0 raises it, naming this rank
                result = RankError(tp.rank, f"{type(exc).__name__}: {exc}")
            messages.gather_results(result)


def agree_on_slots(n_slots: int, device: torch.device, timeout: float) -> int:
    """The smallest KV slot count over the ranks (every rank's storage must hold the same slots): the
    last step of the start-up, after which every collective fails after ``timeout`` seconds."""
    count = torch.tensor([n_slots], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
    group.start_collective_timeout(timeout)
    return int(count.item())
