"""The messages rank 0 broadcasts to the tensor-parallel workers: a step (a
:class:`~tokenmill.worker.forward_step.ForwardStep`), heartbeats while idle, weight updates, LoRA
slot loads, and shutdown.

A step is two broadcasts from rank 0: a fixed-size int64 header (the kind and the lengths), then
one int64 payload with every field back to back; the other kinds are the header alone (a weight
update's tensors follow it: ``weights.py``; a LoRA slot load's adapter: ``lora.py``). The step
carries the request-to-token entries rank 0 wrote since the previous one, which each worker
applies to its replica of the table before it runs the step, so every rank builds the same
attention view over its own KV storage.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

from tokenmill.worker.forward_step import ForwardStep, TableWrites

HEADER_LEN = 9


class Kind(IntEnum):
    STEP = 1
    HEARTBEAT = 2
    SHUTDOWN = 3
    WEIGHTS = 4
    LORA = 5


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


def receive(device: torch.device | str) -> tuple[Kind, ForwardStep | None]:
    """The next message from rank 0 on a worker: ``(kind, the step or None)``."""
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
