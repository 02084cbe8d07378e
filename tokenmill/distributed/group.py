"""The tensor-parallel process group: rendezvous, backend choice, CPU thread split.

Rank 0 hosts the rendezvous (a ``TCPStore`` on a free port it binds itself, so no port is guessed);
workers connect to it. The backend is gloo on CPU and NCCL on CUDA. Until the ranks have started
and loaded their shards (the rendezvous and the KV size agreement), collectives may take up to
:data:`STARTUP_TIMEOUT_S`; from :func:`start_collective_timeout` on, ``timeout`` bounds every
collective: a peer that dies or hangs makes the collective raise instead of blocking forever.
Under ``torchrun`` (every rank started by it, on one machine or several) nothing is spawned: each
process's place comes from the environment torchrun sets (:func:`launched_place`) and the group
rendezvouses through it (``env://``, torchrun's store at ``MASTER_ADDR:MASTER_PORT``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.model.parallel import TensorParallel

STARTUP_TIMEOUT_S = 600.0
"""Seconds the ranks get to start (spawn, import, rendezvous) and load their shards."""


LAUNCH_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables ``torchrun`` sets in each process it starts (``env://`` rendezvous)."""


@dataclass(frozen=True)
class LaunchedPlace:
    """A process's place in a group that ``torchrun`` started: its rank of ``size``, and on its machine."""

    rank: int
    size: int
    local_rank: int
    local_size: int


def launched_place() -> LaunchedPlace | None:
    """This process's place when ``torchrun`` started it (every variable of :data:`LAUNCH_ENVIRONMENT`
    set), else None."""
    if not all(name in os.environ for name in LAUNCH_ENVIRONMENT):
        return None
    rank, size, local_rank, local_size = (int(os.environ[name]) for name in LAUNCH_ENVIRONMENT[:4])
    return LaunchedPlace(rank, size, local_rank, local_size)


def check_launched_size(place: LaunchedPlace, tensor_parallel_size: int) -> None:
    """Raise ValueError unless torchrun started exactly ``tensor_parallel_size`` processes."""
    if place.size != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) must equal the number of processes torchrun "
            f"started (WORLD_SIZE={place.size}: --nnodes x --nproc-per-node)"
        )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a rank: its own GPU on CUDA (``cuda:<local_rank>``), the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def cpu_threads_per_rank(local_size: int) -> int:
    """Torch threads for one of ``local_size`` ranks sharing this machine's CPUs (at least 1)."""
    return max(1, (os.cpu_count() or 1) // local_size)


def startup_timeout(timeout: float) -> float:
    """The collective timeout while the ranks start: :data:`STARTUP_TIMEOUT_S`, or ``timeout`` if longer."""
    return max(timeout, STARTUP_TIMEOUT_S)


def host_store(size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        size,
        is_master=True,
        timeout=timedelta(seconds=startup_timeout(timeout)),
        wait_for_workers=False,
    )


def join(rank: int, size: int, device: torch.device, timeout: float, store: dist.Store | None = None) -> TensorParallel:
    """Join the default process group as ``rank`` of ``size`` (through ``store``, or the ``torchrun``
    environment when None), with the start-up timeout; the model's :class:`TensorParallel`."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=startup_timeout(timeout)),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return TensorParallel(size=size, rank=rank)


def start_collective_timeout(timeout: float) -> None:
    """From now on every collective of the group fails after ``timeout`` seconds (the ranks have started)."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))


def leave() -> None:
    """Leave the default process group (no-op when not in one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
