"""Constants and launch helpers shared by the Triton attention kernels."""

from __future__ import annotations

import torch
import triton

LOG2E = 1.4426950408889634
BLOCK_N = 64
"""KV positions per inner-loop chunk (decode and prefill)."""
MIN_DOT = 16
"""Smallest ``tl.dot`` tile dimension; smaller head groups / head dims / q tiles are padded to it."""


def dot_block(n: int) -> int:
    """Power-of-two ``tl.dot`` tile size covering ``n``."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 dots (matching the torch reference); 16-bit ones the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"
