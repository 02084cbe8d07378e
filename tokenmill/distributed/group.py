"""The tensor-parallel process group: rendezvous, backend choice, CPU thread split.

Rank 0 hosts the rendezvous (a ``TCPStore`` on a free port it binds itself, so no port is guessed);
workers connect to it. The backend is gloo on CPU and NCCL on CUDA. ``timeout`` bounds every
collective (and the rendezvous): a peer that dies or hangs makes the collective raise instead of
blocking forever. Under ``torchrun`` the group comes from its environment instead (``env://``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.model.parallel import TensorParallel


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a rank: its own GPU on CUDA (``cuda:<local_rank>``), the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def cpu_threads_per_rank(size: int) -> int:
    """Torch threads for one of ``size`` ranks sharing this machine's CPUs (at least 1)."""
    return max(1, (os.cpu_count() or 1) // size)


def host_store(size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``)."""
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )


def join(rank: int, size: int, device: torch.device, timeout: float, store: dist.Store | None = None) -> TensorParallel:
    """Join the default process group as ``rank`` of ``size`` (through ``store``, or the ``torchrun``
    environment when None); the model's :class:`TensorParallel`."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return TensorParallel(size=size, rank=rank)


def leave() -> None:
    """Leave the default process group (no-op when not in one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
