"""LoRA slot loads across the tensor-parallel ranks.

When rank 0's adapter manager puts an adapter into a slot (or empties one), between two steps, it
sends the :attr:`~messages.Kind.LORA` message and broadcasts ``(slot, deltas)``: the adapter's whole,
already checked matrices. Each worker puts its own part of them into the same slot of its model
(``model/lora.py``'s ``LoRASlots.load``), so every rank's slot ``s`` holds the same adapter before
the next step runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenmill.model.lora import LoRASlots, ModuleDelta


def send(slot: int, deltas: list[ModuleDelta], device: torch.device) -> None:
    """Rank 0, after the LORA message: what ``slot`` holds from now on (no deltas: nothing)."""
    dist.broadcast_object_list([(slot, deltas)], src=0, device=device)


def receive(slots: LoRASlots, device: torch.device) -> None:
    """A worker after the LORA message: load its part of the adapter into the slot."""
    received: list[tuple[int, list[ModuleDelta]] | None] = [None]
    dist.broadcast_object_list(received, src=0, device=device)
    assert received[0] is not None
    slot, deltas = received[0]
    slots.load(slot, deltas)
