"""Tests for tokenmill.cache.allocator.PageAllocator."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tokenmill.cache.allocator import PageAllocator


def t(*pages: int) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.int64)


@pytest.mark.parametrize(
    ("n_pages", "page_size"),
    [(1, 1), (0, 4), (-3, 4), (8, 0), (8, 3), (8, 512), (8, -2), (8.0, 4), (8, True)],
)
def test_rejects_bad_arguments(n_pages, page_size) -> None:
    with pytest.raises(ValueError):
        PageAllocator(n_pages, page_size)


@pytest.mark.parametrize("page_size", [1, 2, 16, 256])
def test_fresh_allocator_sizes(page_size: int) -> None:
    a = PageAllocator(10, page_size)
    assert (a.n_pages, a.capacity, a.page_size) == (10, 9, page_size)
    assert (a.n_free, a.n_used, a.usage) == (9, 0, 0.0)
    assert not a.is_free(0)
    assert all(a.is_free(p) for p in range(1, 10))


def test_alloc_sets_refcount_one_and_never_hands_out_page_0() -> None:
    a = PageAllocator(5, 4)
    pages = a.alloc(4)
    assert pages is not None and pages.dtype == torch.int64
    assert sorted(pages.tolist()) == [1, 2, 3, 4]
    assert a.refcount(pages).tolist() == [1, 1, 1, 1]
    assert a.refcount(t(0)).tolist() == [0]
    assert (a.n_free, a.n_used, a.usage) == (0, 4, 1.0)
    assert a.alloc(1) is None


def test_alloc_zero_and_negative() -> None:
    a = PageAllocator(3, 1)
    empty = a.alloc(0)
    assert empty is not None and empty.numel() == 0 and empty.dtype == torch.int64
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_alloc_is_all_or_nothing() -> None:
    a = PageAllocator(6, 2)
    first = a.alloc(3)
    assert first is not None
    assert a.alloc(3) is None
    assert (a.n_free, a.n_used) == (2, 3)
    assert a.refcount(first).tolist() == [1, 1, 1]
    rest = a.alloc(2)
    assert rest is not None and set(rest.tolist()).isdisjoint(first.tolist())


def test_incref_decref_and_reuse() -> None:
    a = PageAllocator(4, 1)
    pages = a.alloc(2)
    assert pages is not None
    a.incref(pages[:1])
    assert a.refcount(pages).tolist() == [2, 1]
    assert a.decref(pages) == 1
    assert a.refcount(pages).tolist() == [1, 0]
    assert a.is_free(int(pages[1])) and not a.is_free(int(pages[0]))
    assert a.decref(pages[:1]) == 1
    assert a.n_free == 3
    again = a.alloc(3)
    assert again is not None and sorted(again.tolist()) == [1, 2, 3]


def test_double_free_raises_and_changes_nothing() -> None:
    a = PageAllocator(4, 1)
    pages = a.alloc(2)
    assert pages is not None
    assert a.decref(pages[1:]) == 1
    with pytest.raises(RuntimeError, match="double free"):
        a.decref(pages)
    assert a.refcount(pages).tolist() == [1, 0]
    assert a.n_free == 2


def test_incref_of_free_page_raises() -> None:
    a = PageAllocator(4, 1)
    with pytest.raises(RuntimeError):
        a.incref(t(1))
    assert a.refcount(t(1)).tolist() == [0]


@pytest.mark.parametrize("op", ["incref", "decref"])
def test_reserved_and_out_of_range_pages_rejected(op: str) -> None:
    a = PageAllocator(4, 1)
    a.alloc(3)
    for bad in (t(0), t(4), t(-1)):
        with pytest.raises(ValueError):
            getattr(a, op)(bad)
    with pytest.raises(ValueError):
        getattr(a, op)(torch.tensor([[1]]))
    with pytest.raises(ValueError):
        getattr(a, op)(torch.tensor([1.0]))
    with pytest.raises(TypeError):
        getattr(a, op)([1])


def test_empty_incref_decref() -> None:
    a = PageAllocator(3, 1)
    a.incref(t())
    assert a.decref(t()) == 0
    assert a.n_free == 2


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_slots_of(page_size: int) -> None:
    a = PageAllocator(8, page_size)
    pages = t(3, 0, 5)
    expected = [p * page_size + i for p in (3, 0, 5) for i in range(page_size)]
    slots = a.slots_of(pages)
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected
    assert a.slots_of(t()).numel() == 0


def test_reset_frees_everything() -> None:
    a = PageAllocator(6, 2)
    pages = a.alloc(4)
    assert pages is not None
    a.incref(pages)
    a.reset()
    assert a.n_free == 5 and a.n_used == 0
    assert sorted(a.free_pages().tolist()) == [1, 2, 3, 4, 5]
    assert a.refcount(torch.arange(6)).tolist() == [0] * 6


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/incref/decref sequences checked against a holder-count model."""

    alloc: PageAllocator
    holders: dict[int, int]

    @initialize(n_pages=st.integers(2, 12), page_size=st.sampled_from([1, 2, 4, 256]))
    def create(self, n_pages: int, page_size: int) -> None:
        self.alloc = PageAllocator(n_pages, page_size)
        self.holders = {}

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        free_before = self.alloc.n_free
        pages = self.alloc.alloc(n)
        if n > free_before:
            assert pages is None
            return
        assert pages is not None and pages.numel() == n
        for p in pages.tolist():
            assert p != 0 and p not in self.holders
            self.holders[p] = 1

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.holders)), unique=True))
        self.alloc.incref(torch.tensor(chosen, dtype=torch.int64))
        for p in chosen:
            self.holders[p] += 1

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.holders)), unique=True))
        freed = self.alloc.decref(torch.tensor(chosen, dtype=torch.int64))
        expected_freed = 0
        for p in chosen:
            self.holders[p] -= 1
            if self.holders[p] == 0:
                del self.holders[p]
                expected_freed += 1
        assert freed == expected_freed

    @rule(page=st.integers(1, 11))
    def decref_free_page_raises(self, page: int) -> None:
        if page >= self.alloc.n_pages or page in self.holders:
            return
        with pytest.raises(RuntimeError):
            self.alloc.decref(torch.tensor([page]))

    @rule()
    def release_everything(self) -> None:
        while self.holders:
            pages = sorted(self.holders)
            self.alloc.decref(torch.tensor(pages, dtype=torch.int64))
            for p in pages:
                self.holders[p] -= 1
                if self.holders[p] == 0:
                    del self.holders[p]
        assert self.alloc.n_free == self.alloc.capacity
        assert self.alloc.n_used == 0

    @rule()
    def reset(self) -> None:
        self.alloc.reset()
        self.holders.clear()

    @invariant()
    def consistent(self) -> None:
        a = self.alloc
        refcounts = a.refcount(torch.arange(a.n_pages)).tolist()
        free = a.free_pages().tolist()
        assert len(free) == len(set(free)), "duplicate page on the free list"
        assert refcounts[0] == 0 and 0 not in free
        assert set(free) == {p for p in range(1, a.n_pages) if refcounts[p] == 0}
        for p in range(1, a.n_pages):
            assert refcounts[p] == self.holders.get(p, 0)
            assert a.is_free(p) == (p not in self.holders)
        assert a.n_free == len(free)
        assert a.n_used == len(self.holders)
        assert a.n_free + a.n_used == a.capacity
        assert a.usage == pytest.approx(len(self.holders) / a.capacity)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
