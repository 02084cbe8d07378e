"""LoRA adapter slots: one projection's adapters (:class:`LoRAWeights`), which slot each row of a
step uses (:class:`LoRABatch`) and how that batch reaches the projections (:class:`LoRABinding`).

A projection with LoRA holds :class:`LoRAWeights`: ``max_loras`` slots of stacked, zero-padded
adapter matrices for its ``J`` column segments (the shards of a packed projection: q, k, v; one
for a plain one). Slot ``s`` adds ``x @ a[s, j*R:(j+1)*R].T @ b[s, :, cols_j]`` to output columns
``cols_j`` of segment ``j``: ``a`` ``[S, J*R, in]`` (the adapters' ``lora_A``, rank ``R`` =
``max_lora_rank``, unused ranks zero), ``b`` ``[S, R, out]`` (``lora_B`` transposed, its scaling
folded in). A slot holding no adapter is all zeros.

:class:`LoRABatch` says which slot each row of a step's flat batch uses (-1: none), grouped by slot
once per step, and cuts each slot's rows into tiles for the Triton kernels (:attr:`LoRABatch.tiles`).
:class:`LoRABinding` is how the step's batch reaches the projections: the model worker binds it for
one forward and unbinds it after (one object shared by a model's LoRA projections; None outside a
forward with adapters). The products themselves are ``kernels/lora.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

TILE_ROWS = 16
"""Rows of one slot per tile of :attr:`LoRABatch.tiles` (the Triton kernels' row block)."""


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter slot each of a step's ``T`` rows uses, grouped by slot.

    ``order`` lists the rows that use a slot, sorted by slot (stable: batch order within a slot);
    ``order[bounds[i]:bounds[i + 1]]`` are the rows of slot ``slots[i]``. Pure data, CPU tensors
    or the model's device's.
    """

    n_rows: int
    order: torch.Tensor  # [N] int64
    bounds: list[int]  # [len(slots) + 1]
    slots: list[int]
    bounds_tensor: torch.Tensor  # ``bounds`` and ``slots`` as CPU int64 tensors (the C++ kernel's operands)
    slots_tensor: torch.Tensor

    @staticmethod
    def from_row_slots(row_slots: torch.Tensor) -> LoRABatch | None:
        """The batch of ``row_slots`` (``[T]`` int64, -1 for rows without an adapter); None when no
        row uses one."""
        used = torch.nonzero(row_slots >= 0).flatten()
        if used.numel() == 0:
            return None
        slot_of_used = row_slots[used]
        sorted_slots, perm = torch.sort(slot_of_used, stable=True)
        slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        bounds = [0, *torch.cumsum(counts, 0).tolist()]
        return LoRABatch(
            row_slots.numel(),
            used[perm].contiguous(),
            bounds,
            slots.tolist(),
            torch.tensor(bounds, dtype=torch.int64),
            slots.to("cpu", torch.int64),
        )

    @cached_property
    def tiles(self) -> torch.Tensor:
        """``[n_tiles, 3]`` int32 on ``order``'s device: each tile's slot and its span
        ``[start, end)`` of ``order`` (at most ``TILE_ROWS`` rows, all of that slot)."""
        tiles = [
            (slot, start, min(start + TILE_ROWS, self.bounds[i + 1]))
            for i, slot in enumerate(self.slots)
            for start in range(self.bounds[i], self.bounds[i + 1], TILE_ROWS)
        ]
        return torch.tensor(tiles, dtype=torch.int32).to(self.order.device)


class LoRABinding:
    """The batch a model's LoRA projections read during one forward (None: no adapter rows)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRAWeights:
    """One projection's adapter slots (see the module docstring for the layout). Not a module: its
    tensors are no checkpoint weights and stay out of the model's parameters and buffers."""

    def __init__(
        self,
        binding: LoRABinding,
        max_loras: int,
        max_rank: int,
        in_features: int,
        segments: Sequence[slice],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.binding = binding
        self.rank = max_rank
        self.segments = tuple(segments)  # output columns of each segment, in order, covering the output
        out_features = self.segments[-1].stop
        self.a = torch.zeros(max_loras, len(self.segments) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, max_rank, out_features, dtype=dtype, device=device)
        self.column_bounds = torch.tensor([s.start for s in self.segments] + [out_features], dtype=torch.int64)
        self.device_column_bounds = self.column_bounds.to(device)  # the Triton kernels' copy

    def load(self, slot: int, segment: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
        """Put an adapter's ``lora_a`` ``[r, in]`` and ``lora_b`` ``[cols, r]`` (``cols`` the segment's
        width) for ``segment`` into ``slot``, scaled by ``scaling``; ranks past ``r`` stay zero
        (:meth:`clear` the slot first)."""
        rank, cols = lora_a.shape[0], self.segments[segment]
        with torch.no_grad():
            self.a[slot, segment * self.rank : segment * self.rank + rank].copy_(lora_a)
            self.b[slot, :rank, cols].copy_(lora_b.t() * scaling)

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its delta is zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
