"""The batched LoRA shrink/expand of ``kernels/lora.py`` as two Triton kernels (GPU tensors).

Imported on first use only (by :func:`~tokenmill.kernels.lora.add_lora` for a CUDA batch, or by a
test under ``TRITON_INTERPRET=1``, which triton reads when the kernels below are defined).

One launch per kernel and projection covers every adapter of the step: the batch's rows, sorted
by slot (``LoRABatch.order``), are cut into tiles of ``TILE_ROWS`` rows of one slot each
(``LoRABatch.tiles``), and a program computes one tile's part:

* **shrink**: ``y[i, :] = x[order[i]] @ a[slot].T`` for the tile's sorted positions ``i``, in fp32,
  every segment's ranks at once (``y`` is ``[N, J*R]``, by sorted position);
* **expand**: for segment ``j`` and a block of its output columns,
  ``out[order[i], cols] += y[i, j*R:(j+1)*R] @ b[slot, :, cols]``, summed in fp32 and rounded
  once to ``out``'s dtype. Every output element is written by exactly one program: no atomics.

fp32 operands use exact fp32 dots (the torch reference's results); 16-bit ones round the shrink
to their dtype before the expand's dot (as the torch reference does) and sum in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.lora_slots import TILE_ROWS, LoRABatch, LoRAWeights

MIN_DOT = 16
"""Smallest ``tl.dot`` tile dimension: ranks and column blocks are padded (masked) to at least it."""
BLOCK_K = 64
"""Input features per step of the shrink's inner loop."""
BLOCK_N = 64
"""Output columns per expand program."""


def _dot_block(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    order_ptr,
    tiles_ptr,
    in_features,
    ranks,
    stride_xm,
    stride_as,
    stride_ar,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tiles_ptr + tile * 3).to(tl.int64)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < ranks
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        xs = tl.load(
            x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        a_t = tl.load(  # [BLOCK_K, BLOCK_R]: a[slot]^T
            a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
            mask=mask_k[:, None] & mask_r[None, :],
            other=0.0,
        )
        acc += tl.dot(xs, a_t, input_precision=DOT_PRECISION)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    order_ptr,
    tiles_ptr,
    column_bounds_ptr,
    rank,
    stride_ym,
    stride_bs,
    stride_br,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    segment = tl.program_id(1)
    slot = tl.load(tiles_ptr + tile * 3).to(tl.int64)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    col_lo = tl.load(column_bounds_ptr + segment)
    col_hi = tl.load(column_bounds_ptr + segment + 1)
    offs_n = col_lo + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < col_hi
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        b = tl.load(
            b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )
        y = tl.load(
            y_ptr + offs_m[:, None] * stride_ym + segment * rank + offs_r[None, :],
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )
        acc += tl.dot(y.to(b.dtype), b, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    current = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora_triton(out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, batch: LoRABatch) -> None:
    """:func:`~tokenmill.kernels.lora.add_lora`'s contract (``x`` ``[T, in]``, ``out`` ``[T, out]``,
    contiguous, on the adapters' device) by the two kernels: two launches, no host sync."""
    tiles = batch.tiles
    n_sorted = batch.order.numel()
    rank, n_segments = weights.rank, len(weights.segments)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    ranks = n_segments * rank
    y = torch.empty(n_sorted, ranks, dtype=torch.float32, device=x.device)
    block_r = _dot_block(min(ranks, 64))
    _shrink_kernel[(tiles.shape[0], triton.cdiv(ranks, block_r))](
        x,
        weights.a,
        y,
        batch.order,
        tiles,
        x.shape[1],
        ranks,
        x.stride(0),
        weights.a.stride(0),
        weights.a.stride(1),
        y.stride(0),
        BLOCK_M=TILE_ROWS,
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision,
    )
    widest = max(s.stop - s.start for s in weights.segments)
    block_n = _dot_block(min(widest, BLOCK_N))
    _expand_kernel[(tiles.shape[0], n_segments, triton.cdiv(widest, block_n))](
        y,
        weights.b,
        out,
        batch.order,
        tiles,
        weights.device_column_bounds,
        rank,
        y.stride(0),
        weights.b.stride(0),
        weights.b.stride(1),
        out.stride(0),
        BLOCK_M=TILE_ROWS,
        BLOCK_R=_dot_block(min(rank, 64)),
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
    )
