"""The messages rank 0 broadcasts to the tensor-parallel workers: one per step (token ids, positions,
the rows that need logits, the attention view's index tensors, fork copies), heartbeats while idle,
weight updates, and shutdown.

A step is two broadcasts from rank 0: a fixed-size int64 header (the kind and the lengths), then
one int64 payload with every index tensor back to back; the other kinds are the header alone (a
weight update's tensors follow it: ``weights.py``). The view is sent compacted: the slots of
each request's context (``req_to_token`` rows of the step's requests up to the longest context),
so a worker rebuilds an identical view over its own KV storage (rows ``0..B-1``) without holding
the request table.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from tokenmill.cache.views import DecodeKVCache, KVView

HEADER_LEN = 7


class Kind(IntEnum):
    STEP = 1
    HEARTBEAT = 2
    SHUTDOWN = 3
    WEIGHTS = 4


@dataclass
class StepInputs:
    """Everything a worker's forward of one step needs (tensors on the model's device)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor | None  # [L] int64; None: every row
    seq_lens: list[int]  # [B] KV length of each request after the step
    prefix_lens: list[int]  # [B] tokens cached before the step (decode: seq_lens - 1)
    table: torch.Tensor  # [B, max(seq_lens)] int32: slots of each request's context
    is_decode: bool
    fork_src: torch.Tensor  # [F] int64 slots copied after the forward
    fork_dst: torch.Tensor  # [F] int64


def step_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    view: KVView,
    logits_indices: torch.Tensor | None,
    fork_src: torch.Tensor,
    fork_dst: torch.Tensor,
) -> StepInputs:
    """The inputs of rank 0's step (its view built over the request table), compacted for the workers."""
    is_decode = isinstance(view, DecodeKVCache)
    seq_lens = view.seq_lens.tolist()
    prefix_lens = [n - 1 for n in seq_lens] if is_decode else list(view.prefix_lens_cpu)
    table = view.req_to_token[view.req_pool_indices, : view.max_seq_len]
    return StepInputs(
        input_ids,
        positions,
        view.out_cache_loc,
        logits_indices,
        seq_lens,
        prefix_lens,
        table,
        is_decode,
        fork_src,
        fork_dst,
    )


def send(kind: Kind, step: StepInputs | None = None, device: torch.device | str = "cpu") -> None:
    """Broadcast a message from rank 0 (``step`` for :attr:`Kind.STEP`)."""
    if step is None:
        dist.broadcast(torch.tensor([kind] + [0] * (HEADER_LEN - 1), dtype=torch.int64, device=device), src=0)
        return
    n_tokens, (n_reqs, width) = step.input_ids.numel(), step.table.shape
    n_logits = -1 if step.logits_indices is None else step.logits_indices.numel()
    header = [kind, n_tokens, n_logits, n_reqs, width, step.fork_src.numel(), int(step.is_decode)]
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), src=0)
    parts = [step.input_ids, step.positions, step.out_cache_loc]
    parts += [] if step.logits_indices is None else [step.logits_indices]
    parts += [torch.tensor([step.seq_lens, step.prefix_lens], device=device).view(-1), step.table.reshape(-1)]
    parts += [step.fork_src, step.fork_dst]
    dist.broadcast(torch.cat([p.to(device, torch.int64) for p in parts]), src=0)


def receive(device: torch.device | str) -> tuple[Kind, StepInputs | None]:
    """The next message from rank 0 on a worker: ``(kind, step inputs or None)``."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    kind, n_tokens, n_logits, n_reqs, width, n_forks, is_decode = header.tolist()
    if kind != Kind.STEP:
        return Kind(kind), None
    sizes = [n_tokens, n_tokens, n_tokens, max(n_logits, 0), 2 * n_reqs, n_reqs * width, n_forks, n_forks]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    ids, pos, loc, logits, lens, table, src, dst = payload.split(sizes)
    seq_lens, prefix_lens = lens.view(2, n_reqs).tolist() if n_reqs else ([], [])
    step = StepInputs(
        ids,
        pos,
        loc,
        None if n_logits < 0 else logits,
        seq_lens,
        prefix_lens,
        table.view(n_reqs, width).to(torch.int32),
        bool(is_decode),
        src,
        dst,
    )
    return Kind.STEP, step
