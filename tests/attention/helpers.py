"""Shared builders for the attention tests: paged slot layouts and views over them."""

from __future__ import annotations

import random

import torch

from tokenmill.cache.allocator import PageAllocator
from tokenmill.cache.storage import KVStorage, ReqToTokenPool


class PagedLayout:
    """Requests in ``ReqToTokenPool`` rows, their slots handed out page by page by a ``PageAllocator``.

    Pages are taken from a shuffled free list and requests grow interleaved, so one request's
    pages are scattered and its last page is partly filled (as in the engine).
    """

    def __init__(self, page_size: int, n_pages: int, rows: int, context: int, seed: int = 0) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(n_pages, page_size)
        taken = self.allocator.alloc(n_pages - 1)
        order = taken.tolist()
        random.Random(seed).shuffle(order)
        self.allocator.decref(torch.tensor(order))
        self.pool = ReqToTokenPool(rows, context, "cpu")
        self.lens: dict[int, int] = {}

    def new_row(self) -> int:
        row = self.pool.alloc()
        assert row is not None
        self.lens[row] = 0
        return row

    def extend(self, row: int, n: int) -> torch.Tensor:
        """Slots for the next ``n`` positions of ``row`` (recorded in its table row)."""
        start, ps = self.lens[row], self.page_size
        table = self.pool.table
        for pos in range(start, start + n):
            if pos % ps == 0:
                page = int(self.allocator.alloc(1)[0])
            else:
                page = int(table[row, pos - 1]) // ps
            table[row, pos] = page * ps + pos % ps
        self.lens[row] = start + n
        return table[row, start : start + n].long()

    def extend_interleaved(self, rows: list[int], counts: list[int]) -> list[torch.Tensor]:
        """Extend every row by its count, one position of each row at a time."""
        parts: list[list[torch.Tensor]] = [[] for _ in rows]
        for step in range(max(counts)):
            for i, (row, n) in enumerate(zip(rows, counts)):
                if step < n:
                    parts[i].append(self.extend(row, 1))
        return [torch.cat(p) if p else torch.empty(0, dtype=torch.int64) for p in parts]


def make_storage(n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVStorage:
    """Storage whose every slot (but the zeroed dummy slot 0) holds random keys/values."""
    storage = KVStorage(n_layers, n_slots, n_kv_heads, head_dim, dtype, "cpu")
    storage.k_buffer[:, 1:] = torch.randn(n_layers, n_slots - 1, n_kv_heads, head_dim).to(dtype)
    storage.v_buffer[:, 1:] = torch.randn(n_layers, n_slots - 1, n_kv_heads, head_dim).to(dtype)
    return storage
