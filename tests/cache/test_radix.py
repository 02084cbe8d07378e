"""Tests for tokenmill.cache.radix.RadixCache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.cache.allocator import PageAllocator
from tokenmill.cache.radix import RadixCache, RadixNode


def make(n_pages: int, page_size: int) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(n_pages, page_size)
    return alloc, RadixCache(alloc)


def take(alloc: PageAllocator, n: int) -> torch.Tensor:
    pages = alloc.alloc(n)
    assert pages is not None
    return pages


def seq(n_pages: int, page_size: int, start: int) -> list[int]:
    """Distinct tokens ``start, start+1, ...`` filling ``n_pages`` pages."""
    return list(range(start, start + n_pages * page_size))


def cache_finished(alloc: PageAllocator, cache: RadixCache, tokens: list[int], namespace: str = "") -> torch.Tensor:
    """Simulate a finished request: alloc its pages, insert them (in ``namespace``), drop its own references."""
    pages = take(alloc, len(tokens) // cache.page_size)
    cache.insert(tokens, pages, namespace)
    alloc.decref(pages)
    return pages


def rc(alloc: PageAllocator, pages: torch.Tensor) -> list[int]:
    return alloc.refcount(pages).tolist()


def tree_nodes(cache: RadixCache) -> list[RadixNode]:
    out = [cache.root]
    for node in out:
        out.extend(node.children.values())
    return out


def test_empty_cache_matches_nothing() -> None:
    _, cache = make(4, 2)
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.n_tokens == 0 and m.pages.numel() == 0 and m.pages.dtype == torch.int64
    assert m.node is cache.root
    assert cache.match_prefix([]).n_tokens == 0


def test_token_level_insert_match_and_split() -> None:
    alloc, cache = make(8, 1)
    pages = take(alloc, 3)
    assert cache.insert([1, 2, 3], pages) == 0
    assert rc(alloc, pages) == [2, 2, 2]
    assert cache.n_cached_pages == 3

    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.n_tokens, m.pages.tolist()) == (3, pages.tolist())

    m = cache.match_prefix([1, 2, 9])
    assert (m.n_tokens, m.pages.tolist()) == (2, pages[:2].tolist())
    assert m.node.key == (1, 2) and list(m.node.children) == [(3,)]
    assert m.node.children[(3,)].pages.tolist() == pages[2:].tolist()

    assert cache.match_prefix([7]).n_tokens == 0
    assert cache.n_cached_pages == 3
    assert rc(alloc, pages) == [2, 2, 2]


def test_paged_match_uses_whole_pages_only() -> None:
    alloc, cache = make(8, 4)
    tokens = seq(2, 4, 0)
    pages = take(alloc, 2)
    cache.insert(tokens, pages)

    assert cache.match_prefix(tokens).pages.tolist() == pages.tolist()
    m = cache.match_prefix(tokens[:7])
    assert (m.n_tokens, m.pages.tolist()) == (4, pages[:1].tolist())
    m = cache.match_prefix(tokens[:6] + [99, 99])
    assert (m.n_tokens, m.pages.tolist()) == (4, pages[:1].tolist())
    assert cache.match_prefix(tokens[:3]).n_tokens == 0
    m = cache.match_prefix(tokens + [1, 2, 3])
    assert m.n_tokens == 8


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_insert_diverging_mid_node_splits_at_page_boundary(page_size: int) -> None:
    alloc, cache = make(16, page_size)
    a_tokens = seq(3, page_size, 0)
    a_pages = take(alloc, 3)
    assert cache.insert(a_tokens, a_pages) == 0

    # Diverge in the middle of the second page (at its first token when page_size == 1).
    cut = page_size + page_size // 2
    b_tokens = a_tokens[:cut] + seq(3, page_size, 1000)[: 3 * page_size - cut]
    b_pages = take(alloc, 3)
    assert cache.insert(b_tokens, b_pages) == page_size
    # The tree kept its own first page; the caller's duplicate was not incref'd.
    assert rc(alloc, b_pages) == [1, 2, 2]
    assert rc(alloc, a_pages) == [2, 2, 2]
    assert cache.n_cached_pages == 5

    shared = cache.match_prefix(a_tokens[:page_size]).node
    assert shared.key == tuple(a_tokens[:page_size]) and len(shared.children) == 2
    m = cache.match_prefix(b_tokens)
    assert m.n_tokens == 3 * page_size
    assert m.pages.tolist() == [a_pages[0].item(), *b_pages[1:].tolist()]
    assert cache.match_prefix(a_tokens).pages.tolist() == a_pages.tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_prefix_of_existing_and_existing_sequence(page_size: int) -> None:
    alloc, cache = make(16, page_size)
    tokens = seq(3, page_size, 5)
    pages = take(alloc, 3)
    cache.insert(tokens, pages)

    dup = take(alloc, 2)
    assert cache.insert(tokens[: 2 * page_size], dup) == 2 * page_size
    assert rc(alloc, dup) == [1, 1]
    assert cache.match_prefix(tokens[: 2 * page_size]).node.key == tuple(tokens[: 2 * page_size])
    dup3 = take(alloc, 3)
    assert cache.insert(tokens, dup3) == 3 * page_size
    assert rc(alloc, dup3) == [1, 1, 1]
    assert cache.n_cached_pages == 3
    assert cache.match_prefix(tokens).pages.tolist() == pages.tolist()


def test_insert_extends_existing_leaf() -> None:
    alloc, cache = make(16, 2)
    tokens = seq(2, 2, 0)
    pages = take(alloc, 2)
    cache.insert(tokens, pages)
    longer = tokens + [50, 51, 52, 53]
    mine = torch.cat([pages, take(alloc, 2)])
    assert cache.insert(longer, mine) == 4
    assert rc(alloc, mine) == [2, 2, 2, 2]
    assert cache.match_prefix(longer).pages.tolist() == mine.tolist()
    assert cache.n_cached_pages == 4


def test_insert_validates_arguments() -> None:
    alloc, cache = make(8, 4)
    pages = take(alloc, 2)
    with pytest.raises(ValueError):
        cache.insert(seq(2, 4, 0)[:-1], pages)
    with pytest.raises(ValueError):
        cache.insert(seq(1, 4, 0), pages)
    with pytest.raises(ValueError):
        cache.insert(seq(2, 4, 0), pages.to(torch.int32))
    assert cache.insert([], pages[:0]) == 0
    assert cache.n_cached_pages == 0


def test_insert_of_unallocated_pages_raises() -> None:
    alloc, cache = make(8, 1)
    with pytest.raises(RuntimeError):
        cache.insert([1, 2], torch.tensor([3, 4]))


def test_lru_eviction_order() -> None:
    alloc, cache = make(8, 2)
    x, y, z = seq(1, 2, 0), seq(1, 2, 10), seq(1, 2, 20)
    px = cache_finished(alloc, cache, x)
    py = cache_finished(alloc, cache, y)
    pz = cache_finished(alloc, cache, z)
    cache.match_prefix(x)  # x is now the most recently used

    assert cache.evict(1) == 1
    assert alloc.is_free(int(py)) and cache.match_prefix(y).n_tokens == 0
    assert cache.evict(1) == 1
    assert alloc.is_free(int(pz))
    assert cache.evict(1) == 1
    assert alloc.is_free(int(px))
    assert cache.evict(1) == 0
    assert alloc.n_free == alloc.capacity and cache.n_cached_pages == 0


def test_parent_evicted_only_after_children() -> None:
    alloc, cache = make(8, 1)
    cache_finished(alloc, cache, [1, 2])
    cache_finished(alloc, cache, [1, 3])
    parent = cache.match_prefix([1]).node
    assert parent.key == (1,) and len(parent.children) == 2
    # Refresh only the parent: it is now the most recent node but still not a leaf.
    cache.match_prefix([1])
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2]).n_tokens == 1  # the older leaf went first
    assert cache.match_prefix([1, 3]).n_tokens == 2
    assert cache.n_cached_pages == 2
    assert cache.evict(1) == 1
    assert cache.n_cached_pages == 1 and cache.match_prefix([1]).n_tokens == 1
    assert cache.evict(1) == 1
    assert cache.n_cached_pages == 0

    cache_finished(alloc, cache, [1, 2])
    cache_finished(alloc, cache, [1, 3])
    assert cache.evict(10) == 3
    assert alloc.n_free == alloc.capacity


def test_locked_nodes_are_never_evicted() -> None:
    alloc, cache = make(8, 2)
    x, y = seq(2, 2, 0), seq(2, 2, 10)
    px = cache_finished(alloc, cache, x)
    cache_finished(alloc, cache, y)
    m = cache.match_prefix(x[:2])
    alloc.incref(m.pages)
    cache.lock(m.node)
    assert cache.n_evictable_pages == 3

    # x's second page is an unlocked leaf under the locked node; y is unlocked.
    assert cache.evict(100) == 3
    assert cache.n_cached_pages == 1 and cache.n_evictable_pages == 0
    assert rc(alloc, px) == [2, 0]

    cache.unlock(m.node)
    assert cache.n_evictable_pages == 1
    assert cache.evict(1) == 0  # the request still holds the page
    assert cache.n_cached_pages == 0
    assert alloc.decref(m.pages) == 1
    assert alloc.n_free == alloc.capacity


def test_full_pool_evicts_only_unreferenced_unlocked_leaves() -> None:
    alloc, cache = make(9, 2)  # capacity 8
    # Unlocked, unreferenced: evictable and freeable.
    free_a = cache_finished(alloc, cache, seq(2, 2, 0))
    free_b = cache_finished(alloc, cache, seq(1, 2, 10))
    # Locked by a running request.
    locked = cache_finished(alloc, cache, seq(2, 2, 20))
    m = cache.match_prefix(seq(2, 2, 20))
    alloc.incref(m.pages)
    cache.lock(m.node)
    # In the tree but also held by a running request that did not lock it.
    held_tokens = seq(1, 2, 30)
    held = take(alloc, 1)
    cache.insert(held_tokens, held)
    # Held by a running request only (not cached).
    private = take(alloc, 2)
    assert alloc.n_free == 0

    assert cache.evict(alloc.capacity) == 3
    assert sorted(alloc.free_pages().tolist()) == sorted(free_a.tolist() + free_b.tolist())
    assert rc(alloc, locked) == [2, 2]
    assert rc(alloc, held) == [1]
    assert rc(alloc, private) == [1, 1]
    assert cache.match_prefix(seq(2, 2, 20)).n_tokens == 4
    assert cache.match_prefix(held_tokens).n_tokens == 0


def test_evict_nonpositive_is_noop() -> None:
    alloc, cache = make(4, 1)
    cache_finished(alloc, cache, [1])
    assert cache.evict(0) == 0 and cache.evict(-3) == 0
    assert cache.n_cached_pages == 1


def test_reset_with_locked_nodes_then_unlock_is_harmless() -> None:
    alloc, cache = make(12, 2)
    tokens = seq(3, 2, 0)
    pages = take(alloc, 3)
    cache.insert(tokens, pages)
    alloc.decref(pages)
    m = cache.match_prefix(tokens[:4])
    alloc.incref(m.pages)
    cache.lock(m.node)
    old_node = m.node

    cache.reset()
    assert cache.n_cached_pages == 0 and cache.n_evictable_pages == 0
    assert rc(alloc, pages) == [1, 1, 0]
    assert cache.match_prefix(tokens).n_tokens == 0

    # The new tree is independent of the detached nodes.
    fresh = cache_finished(alloc, cache, tokens)
    m2 = cache.match_prefix(tokens)
    cache.lock(m2.node)
    cache.unlock(old_node)
    cache.unlock(old_node)  # even an unbalanced unlock of a detached node is ignored
    assert [n.lock_count for n in tree_nodes(cache)] == [1, 1]
    assert cache.n_evictable_pages == 0
    with pytest.raises(RuntimeError):
        cache.lock(old_node)
    cache.unlock(m2.node)
    assert cache.n_evictable_pages == 3

    alloc.decref(m.pages)
    cache.reset()
    assert rc(alloc, fresh) == [0, 0, 0]
    assert alloc.n_free == alloc.capacity


def test_unlock_without_lock_raises() -> None:
    alloc, cache = make(4, 1)
    cache_finished(alloc, cache, [1])
    node = cache.match_prefix([1]).node
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_lock_of_evicted_node_raises() -> None:
    alloc, cache = make(4, 1)
    cache_finished(alloc, cache, [1])
    node = cache.match_prefix([1]).node
    assert cache.evict(1) == 1
    with pytest.raises(RuntimeError):
        cache.lock(node)


def test_lock_survives_split_of_locked_node() -> None:
    alloc, cache = make(8, 1)
    cache_finished(alloc, cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    # Splitting the locked node keeps both halves locked.
    cache_finished(alloc, cache, [1, 9])
    assert cache.n_evictable_pages == 1
    assert cache.evict(10) == 1
    cache.unlock(m.node)
    assert all(n.lock_count == 0 for n in tree_nodes(cache))
    assert cache.evict(10) == 3
    assert alloc.n_free == alloc.capacity


# ---------------------------------------------------------------------------
# Randomised request simulation.

# Shared prefixes over a 3-token vocabulary, so that requests collide often.
PREFIXES = [
    (0, 1, 2, 0, 1, 2, 0, 1),
    (0, 0, 0, 0, 1, 1, 1, 1),
    (0, 1, 2, 0, 0, 0, 0, 0),
]

token_seqs = st.builds(
    lambda prefix, cut, tail: prefix[:cut] + tuple(tail),
    st.sampled_from(PREFIXES),
    st.integers(1, 8),
    st.lists(st.integers(0, 2), max_size=4),
)


@dataclass
class Request:
    tokens: tuple[int, ...]
    pages: list[int]
    node: RadixNode
    epoch: int
    n_matched: int


class RadixMachine(RuleBasedStateMachine):
    """Requests share prefixes through the cache under a small, often full, pool."""

    alloc: PageAllocator
    cache: RadixCache
    requests: dict[int, Request]
    # Token prefix (up to the end of the page) whose KV each allocated page stores.
    content: dict[int, tuple[int, ...]]

    @initialize(page_size=st.sampled_from([1, 2, 4]), pool_tokens=st.integers(4, 40))
    def setup(self, page_size: int, pool_tokens: int) -> None:
        self.alloc, self.cache = make(max(2, 1 + pool_tokens // page_size), page_size)
        self.ps = page_size
        self.requests = {}
        self.content = {}
        self.next_id = 0
        self.epoch = 0

    # -- helpers ----------------------------------------------------------

    def alloc_or_evict(self, n: int) -> torch.Tensor | None:
        pages = self.alloc.alloc(n)
        if pages is None:
            self.cache.evict(n - self.alloc.n_free)
            pages = self.alloc.alloc(n)
        return pages

    def cached_prefixes(self) -> set[tuple[int, ...]]:
        return {self.content[p] for p in self.tree_pages()}

    def tree_pages(self) -> list[int]:
        return [p for node in tree_nodes(self.cache) for p in node.pages.tolist()]

    def check_match(self, tokens: tuple[int, ...], pages: torch.Tensor, n_tokens: int) -> None:
        ps = self.ps
        assert n_tokens == pages.numel() * ps <= len(tokens)
        for i, p in enumerate(pages.tolist()):
            assert self.content[p] == tokens[: (i + 1) * ps]
        nxt = n_tokens + ps
        if nxt <= len(tokens):
            assert tokens[:nxt] not in self.cached_prefixes(), "match is not maximal"

    def release(self, rid: int, insert: bool) -> None:
        req = self.requests.pop(rid)
        if insert:
            full = len(req.tokens) // self.ps
            present = self.cache.insert(req.tokens[: full * self.ps], torch.tensor(req.pages[:full], dtype=torch.int64))
            assert present % self.ps == 0
            if req.epoch == self.epoch:
                assert present >= req.n_matched
        self.alloc.decref(torch.tensor(req.pages, dtype=torch.int64))
        self.cache.unlock(req.node)

    def start(self, tokens: tuple[int, ...]) -> int | None:
        """Admit a request the way the cache manager does; return its id, or None if no room."""
        ps = self.ps
        m = self.cache.match_prefix(tokens)
        self.check_match(tokens, m.pages, m.n_tokens)
        self.alloc.incref(m.pages)
        self.cache.lock(m.node)
        n_new = -(-len(tokens) // ps) - m.pages.numel()
        new = self.alloc_or_evict(n_new)
        if new is None:
            self.cache.unlock(m.node)
            self.alloc.decref(m.pages)
            return None
        pages = m.pages.tolist() + new.tolist()
        for i in range(m.pages.numel(), len(pages)):
            self.content[pages[i]] = tokens[: (i + 1) * ps]
        rid = self.next_id
        self.next_id += 1
        self.requests[rid] = Request(tokens, pages, m.node, self.epoch, m.n_tokens)
        return rid

    # -- rules --------------------------------------------------------------

    @rule(tokens=token_seqs)
    def start_request(self, tokens: tuple[int, ...]) -> None:
        self.start(tokens)

    @rule(tokens=token_seqs)
    def serve_request(self, tokens: tuple[int, ...]) -> None:
        """Admit a request and finish it at once, caching its pages."""
        rid = self.start(tokens)
        if rid is not None:
            self.release(rid, insert=True)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def decode_token(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[rid]
        tokens = req.tokens + (data.draw(st.integers(0, 2)),)
        if len(tokens) > len(req.pages) * self.ps:
            new = self.alloc_or_evict(1)
            if new is None:
                return
            req.pages.append(int(new))
        req.tokens = tokens
        self.content[req.pages[-1]] = tokens[: len(req.pages) * self.ps]

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def cache_running_request(self, data: st.DataObject) -> None:
        """Insert a running request's full pages; it keeps holding them, unlocked."""
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        full = len(req.tokens) // self.ps
        self.cache.insert(req.tokens[: full * self.ps], torch.tensor(req.pages[:full], dtype=torch.int64))

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data(), insert=st.booleans())
    def finish_request(self, data: st.DataObject, insert: bool) -> None:
        self.release(data.draw(st.sampled_from(sorted(self.requests))), insert)

    @precondition(lambda self: self.cache.n_cached_pages > 0)
    @rule(tokens=token_seqs)
    def lookup(self, tokens: tuple[int, ...]) -> None:
        m = self.cache.match_prefix(tokens)
        self.check_match(tokens, m.pages, m.n_tokens)

    @precondition(lambda self: self.cache.n_cached_pages > 0)
    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        free_before = self.alloc.n_free
        freed = self.cache.evict(n)
        assert freed == self.alloc.n_free - free_before
        if freed < n:
            assert self.cache.n_evictable_pages == 0
            assert all(node.lock_count > 0 for node in tree_nodes(self.cache)[1:])

    @precondition(lambda self: self.cache.n_cached_pages > 0)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.epoch += 1

    # -- invariants -----------------------------------------------------------

    @invariant()
    def check_consistent(self) -> None:
        cache, alloc, ps = self.cache, self.alloc, self.ps
        expected_locks: dict[int, int] = {}
        for req in self.requests.values():
            if req.epoch != self.epoch:
                continue
            node: RadixNode | None = req.node
            while node is not None:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                top, node = node, node.parent
            assert top is cache.root, "a locked node left the live tree"

        tree_pages: list[int] = []
        evictable = 0
        stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
        while stack:
            node, path = stack.pop()
            assert node.lock_count == expected_locks.get(id(node), 0)
            if node is not cache.root:
                assert node.key and len(node.key) == node.n_pages * ps
                if node.lock_count == 0:
                    evictable += node.n_pages
            path = path + node.key
            start = len(path) - len(node.key)
            for i, p in enumerate(node.pages.tolist()):
                assert self.content[p] == path[: start + (i + 1) * ps]
                tree_pages.append(p)
            for first, child in node.children.items():
                assert child.parent is node and child.key[:ps] == first
                stack.append((child, path))

        assert len(tree_pages) == len(set(tree_pages)), "a page is stored twice in the tree"
        assert cache.n_cached_pages == len(tree_pages)
        assert cache.n_evictable_pages == evictable

        in_tree = set(tree_pages)
        held: dict[int, int] = {}
        for req in self.requests.values():
            assert len(req.pages) == len(set(req.pages))
            for p in req.pages:
                held[p] = held.get(p, 0) + 1
        refcounts = alloc.refcount(torch.arange(alloc.n_pages)).tolist()
        assert refcounts[0] == 0
        for p in range(1, alloc.n_pages):
            expected = held.get(p, 0) + (p in in_tree)
            assert refcounts[p] == expected, (p, refcounts[p], held.get(p, 0), p in in_tree)
        free = set(alloc.free_pages().tolist())
        assert free.isdisjoint(held) and free.isdisjoint(in_tree)
        assert alloc.n_free + len(set(held) | in_tree) == alloc.capacity

    def teardown(self) -> None:
        """Finish every request and drop the tree: no page may leak."""
        if not hasattr(self, "cache"):
            return
        for rid in sorted(self.requests):
            self.release(rid, insert=True)
        self.check_consistent()
        self.cache.reset()
        self.epoch += 1
        self.check_consistent()
        assert self.alloc.n_free == self.alloc.capacity


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
