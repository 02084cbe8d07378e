"""LoRA products: the batched shrink/expand of a projection's adapter slots over a step's rows.

The slots (:class:`LoRAWeights`: ``a`` ``[S, J*R, in]``, ``b`` ``[S, R, out]``, a slot without an
adapter all zeros), the step's rows grouped by slot (:class:`LoRABatch`) and :class:`LoRABinding`
live in ``kernels/lora_slots.py`` (its docstring gives the layout) and are importable from here too.
:func:`add_lora` adds every row's delta in one call per projection: the C++
``lora_add`` (rows sorted by slot, each slot's matrices streamed once) for CPU batches of at most
``CPP_MAX_ROWS`` rows, two Triton kernels for CUDA batches (``kernels/lora_triton.py``: tiles of
one slot's rows, :attr:`LoRABatch.tiles`), else per slot two matmuls on that slot's rows (at most
``max_loras`` of them; never a loop per request).
"""

from __future__ import annotations

import importlib.util

import torch

from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.lora_slots import TILE_ROWS, LoRABatch, LoRABinding, LoRAWeights

__all__ = [
    "CPP_MAX_ROWS",
    "TILE_ROWS",
    "TRITON_AVAILABLE",
    "LoRABatch",
    "LoRABinding",
    "LoRAWeights",
    "add_lora",
    "add_lora_reference",
]

CPP_MAX_ROWS = 256
"""Up to how many rows the C++ kernel computes the LoRA deltas; beyond, per-slot matmuls."""
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
"""Whether CUDA batches can use the Triton kernels (``kernels/lora_triton.py``); else per-slot matmuls."""


def add_lora(out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, batch: LoRABatch) -> None:
    """``out[t] += delta of row t's slot`` for every row of ``batch`` (``x`` ``[T, in]``, ``out``
    ``[T, out]``, both contiguous, ``T == batch.n_rows``), in place."""
    if x.is_cuda and TRITON_AVAILABLE:
        from tokenmill.kernels.lora_triton import add_lora_triton  # imported on use (TRITON_INTERPRET)

        add_lora_triton(out, x, weights, batch)
        return
    if x.is_cpu and x.shape[0] <= CPP_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
        kernels = load_cpu_kernels()
        if kernels is not None:
            order, bounds, slots = batch.order, batch.bounds_tensor, batch.slots_tensor
            kernels.lora_add(out, x, weights.a, weights.b, order, bounds, slots, weights.column_bounds)
            return
    add_lora_reference(out, x, weights, batch)


def add_lora_reference(out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, batch: LoRABatch) -> None:
    """:func:`add_lora` in torch ops: per slot, its rows' shrink and each segment's expand (the
    reference the C++ kernel is tested against; fp32 accumulation as the matmuls do it)."""
    rank = weights.rank
    for i, slot in enumerate(batch.slots):
        rows = batch.order[batch.bounds[i] : batch.bounds[i + 1]]
        whole = rows.numel() == x.shape[0]  # every row uses this slot: no gather or scatter
        xs = x if whole else x.index_select(0, rows)
        shrunk = xs @ weights.a[slot].t()  # [n, J*R]
        delta = torch.cat(
            [
                shrunk[:, j * rank : (j + 1) * rank] @ weights.b[slot, :, cols]
                for j, cols in enumerate(weights.segments)
            ],
            dim=1,
        )
        if whole:
            out += delta
        else:
            out.index_add_(0, rows, delta.to(out.dtype))
