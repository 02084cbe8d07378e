"""The messages rank 0 broadcasts to the tensor-parallel workers: a step (a
:class:`~tokenmill.worker.forward_step.ForwardStep`), a call (a ``ModelWorker`` method every rank
runs: weight updates, LoRA slot loads), heartbeats while idle, and shutdown.

A step is two broadcasts from rank 0: a fixed-size int64 header (the kind and the lengths), then
one int64 payload with every field back to back; a call is the header, then the method's name and
arguments as one pickled object, and every rank's result gathered back (:func:`send_call`); the
other kinds are the header alone. The step
carries the request-to-token entries rank 0 wrote since the previous one, which each worker
applies to its replica of the table before it runs the step, so every rank builds the same
attention view over its own KV storage.
"""

from __future__ import annotations

import pickle
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.worker.forward_step import ForwardStep, TableWrites

HEADER_LEN = 9


class Kind(IntEnum):
    STEP = 1
    HEARTBEAT = 2
    SHUTDOWN = 3
    CALL = 4


Call = tuple[str, tuple[Any, ...]]
"""A call's method name and arguments."""


def send(kind: Kind, step: ForwardStep | None = None, device: torch.device | str = "cpu") -> None:
    """Broadcast a message from rank 0 (``step`` for :attr:`Kind.STEP`)."""
    if step is None:
        dist.broadcast(torch.tensor([kind] + [0] * (HEADER_LEN - 1), dtype=torch.int64, device=device), src=0)
        return
    n_logits = -1 if step.logits_indices is None else step.logits_indices.numel()
    writes = step.table_writes
    header = [
        kind,
        step.input_ids.numel(),
        n_logits,
        len(step.rows),
        step.fork_src.numel(),
        len(writes),
        step.is_decode,
        0 if step.hidden_indices is None else step.hidden_indices.numel(),
        0 if step.lora_slots is None else step.lora_slots.numel(),
    ]
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), src=0)
    parts = [step.input_ids, step.positions, step.out_cache_loc]
    parts += [] if step.logits_indices is None else [step.logits_indices]
    parts += [torch.tensor([step.rows, step.seq_lens, step.prefix_lens], dtype=torch.int64).view(-1)]
    parts += [step.fork_src, step.fork_dst, writes.rows, writes.positions, writes.slots]
    parts += [] if step.hidden_indices is None else [step.hidden_indices]
    parts += [] if step.lora_slots is None else [step.lora_slots]
    dist.broadcast(torch.cat([p.to(device, torch.int64) for p in parts]), src=0)


def send_call(method: str, args: tuple[Any, ...], device: torch.device | str) -> None:
    """Broadcast a call of ``method(*args)`` from rank 0 (the workers answer with :func:`gather_results`).
    The arguments are pickled first: one that cannot be raises before any rank hears of the call."""
    pickle.dumps(args)
    send(Kind.CALL, device=device)
    dist.broadcast_object_list([(method, args)], src=0, device=device)


def receive_call(device: torch.device | str) -> Call:
    """A worker after the CALL header: the method's name and arguments."""
    received: list[Call | None] = [None]
    dist.broadcast_object_list(received, src=0, device=device)
    assert received[0] is not None
    return received[0]


def gather_results(result: Any) -> list[Any]:
    """Every rank's result of a call, by rank (each rank passes its own)."""
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def receive(device: torch.device | str) -> tuple[Kind, ForwardStep | None]:
    """The next message from rank 0 on a worker: ``(kind, the step or None)``; after a CALL header
    the call follows (:func:`receive_call`)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    kind, n_tokens, n_logits, n_reqs, n_forks, n_writes, is_decode, n_hidden, n_lora = header.tolist()
    if kind != Kind.STEP:
        return Kind(kind), None
    sizes = [n_tokens] * 3 + [max(n_logits, 0), 3 * n_reqs] + [n_forks] * 2 + [n_writes] * 3 + [n_hidden, n_lora]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    ids, pos, loc, logits, lens, src, dst, w_rows, w_pos, w_slots, hidden, lora_slots = payload.split(sizes)
    rows, seq_lens, prefix_lens = lens.view(3, n_reqs).tolist() if n_reqs else ([], [], [])
    step = ForwardStep(
        is_decode=bool(is_decode),
        input_ids=ids,
        positions=pos,
        out_cache_loc=loc,
        rows=rows,
        seq_lens=seq_lens,
        prefix_lens=prefix_lens,
        logits_indices=None if n_logits < 0 else logits,
        fork_src=src,
        fork_dst=dst,
        table_writes=TableWrites(w_rows, w_pos, w_slots),
        hidden_indices=hidden if n_hidden else None,
        lora_slots=lora_slots if n_lora else None,
    )
    return Kind.STEP, step
