"""CPU parameters in one anonymous mapping backed by transparent huge pages (2 MB).

A batch-1 decode step reads every weight once, so on CPU it runs at the speed the memory system
streams them; with 4 KB pages each 4 KB of weights also costs a TLB miss (a two-level page walk
under a hypervisor); one 2 MB page entry covers 512 times as much.

Needs Linux with transparent huge pages in "madvise" or "always" mode; elsewhere
``materialize_on_huge_pages`` is a plain ``to_empty``. Parameters become views into the mapping
(module order, each starting on a 64-byte cache line); in-place weight updates keep them there,
and anything that swaps a parameter's storage (``Module.to`` another device or dtype) just leaves
the mapping, which lives as long as some parameter still views it.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

ALIGN_BYTES = 64


def materialize_on_huge_pages(model: nn.Module) -> nn.Module:
    """``model.to_empty(device="cpu")`` with every parameter (uninitialized) in one huge-page
    mapping where the OS supports it. Buffers are allocated as ``to_empty`` does."""
    model.to_empty(device="cpu")
    _into_one_mapping(list(model.parameters()), copy=False)  # shared (tied) parameters appear once
    return model


def move_to_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Move CPU ``tensors`` (parameters or buffers, their values kept) into one new huge-page
    mapping where the OS supports it; the memory they held before is freed once nothing else views it."""
    _into_one_mapping(tensors, copy=True)


def _into_one_mapping(tensors: list[torch.Tensor], copy: bool) -> None:
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    if advise is None or total == 0:
        return
    mapping = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE)  # anonymous; pages committed on first write
    mapping.madvise(advise)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    for tensor, offset in zip(tensors, offsets):
        nbytes = tensor.numel() * tensor.element_size()
        home = arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        if copy:
            home.copy_(tensor.detach())
        tensor.data = home
