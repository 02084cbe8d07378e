"""The greedy pick: each logits row's index of its first maximal entry."""

from __future__ import annotations

import torch

from tokenmill.kernels.cpu import load_cpu_kernels


def first_maxima(logits: torch.Tensor) -> list[int]:
    """Each row of ``logits [rows, vocab]``'s index of its first maximal entry, as torch's
    ``max(dim=-1)`` gives it (a NaN counts as the maximum; a row of -inf gives 0): the C++ kernel
    for fp32 and bf16 CPU logits, torch's reduction in fp32 otherwise."""
    if logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2 and logits.shape[1]:
        kernels = load_cpu_kernels()
        if kernels is not None:
            return kernels.first_maxima(logits).tolist()
    return logits.float().max(dim=-1).indices.tolist()
