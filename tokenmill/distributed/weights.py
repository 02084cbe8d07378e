"""Weight updates across the tensor-parallel ranks, all or nothing.

Rank 0 validates and stages an update first (``engine/weight_update.py``), then, between two steps,
sends the :attr:`~messages.Kind.WEIGHTS` message and broadcasts each validated whole tensor (a manifest
of names, dtypes and shapes, then each tensor's bytes). Every worker checks and stages its own part
of each tensor exactly as rank 0 did (``model.weights.stage_tensor``: a part may still overflow the
parameter's dtype where rank 0's did not), then every rank votes (its refusal, or None). Only when
no rank refused does each one copy its staged parts in, before the next message, so every rank moves
to the new weights at the same step boundary, or none does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.weights import WeightError, checkpoint_targets, stage_tensor

Manifest = list[tuple[str, torch.dtype, tuple[int, ...]]]


def send(tensors: list[tuple[str, torch.Tensor]], device: torch.device) -> list[str | None]:
    """Rank 0: broadcast ``tensors`` (whole, validated) after the WEIGHTS message; every rank's vote
    (rank 0's is None: it staged its part already)."""
    manifest: Manifest = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    dist.broadcast_object_list([manifest], src=0, device=device)
    for _, tensor in tensors:
        data = tensor.contiguous().reshape(-1).view(torch.uint8).to(device)
        if data.numel():
            dist.broadcast(data, src=0)
    return vote(None)


def receive(model: CausalLM, device: torch.device) -> None:
    """A worker after the WEIGHTS message: receive every tensor, stage this rank's part of each,
    vote, and copy the staged parts into ``model`` when no rank refused. A refusal is voted, never
    raised; a failed collective raises (rank 0 is gone)."""
    received: list[Manifest | None] = [None]
    dist.broadcast_object_list(received, src=0, device=device)
    manifest = received[0]
    assert manifest is not None
    targets = checkpoint_targets(model)
    staged = []
    refusal: str | None = None
    for name, dtype, shape in manifest:
        data = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8, device=device)
        if data.numel():
            dist.broadcast(data, src=0)
        if refusal is not None:
            continue  # refused already: receive the rest, stage nothing
        try:
            item = stage_tensor(model, targets, name, data.view(dtype).view(shape), "update")
        except Exception as exc:  # noqa: BLE001 - any failure to stage is this rank's refusal
            refusal = str(exc) if isinstance(exc, WeightError) else f"{type(exc).__name__}: {exc}"
            staged.clear()
            continue
        if item is not None:
            staged.append(item)
    if any(vote(refusal)):
        return
    for target, part in staged:
        target.load(part)


def vote(refusal: str | None) -> list[str | None]:
    """Every rank's refusal (None: ready to apply), by rank."""
    votes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(votes, refusal)
    return votes
