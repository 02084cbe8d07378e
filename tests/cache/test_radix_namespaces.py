"""The namespaces of tokenmill.cache.radix.RadixCache (and their use by CacheManager).

Checked against explicit expectations and a model of the cache: what is matchable in which
namespace, which pages each namespace stores, the reference invariant (a page's refcount equals
its live holders plus 1 if the tree stores it) recomputed from scratch, the counters recomputed
from the tree, LRU eviction across namespaces, removal of emptied namespace roots, and reset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.cache.test_radix import cache_finished, make, seq, take, token_seqs, tree_nodes
from tokenmill.cache.allocator import PageAllocator
from tokenmill.cache.handle import KVHandle
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.radix import RadixCache, RadixNode
from tokenmill.cache.storage import ReqToTokenPool
from tokenmill.config import EngineConfig


def ns_key(namespace: str) -> tuple[str, str]:
    return ("namespace", namespace)


def check_invariants(alloc: PageAllocator, cache: RadixCache, holders: list[torch.Tensor]) -> None:
    """Recompute from scratch: each page's refcount is its holders plus 1 if the tree stores it;
    no page is stored twice; the counters equal the tree's; namespace roots are well formed."""
    tree_pages: list[int] = []
    evictable = 0
    for node in tree_nodes(cache):
        if node is not cache.root:
            assert node.parent is not None and node.parent.children[cache._child_key(node)] is node
            if node.lock_count == 0:
                evictable += node.n_pages
        if node.namespace is not None:  # a namespace root: directly below the root, empty
            assert node.parent is cache.root and node.key == () and node.n_pages == 0
        tree_pages.extend(node.pages.tolist())
    for key, child in cache.root.children.items():
        assert (key == ns_key(child.namespace)) if child.namespace is not None else key == child.key[: cache.page_size]
    assert len(tree_pages) == len(set(tree_pages)), "a page is stored twice in the tree"
    assert cache.n_cached_pages == len(tree_pages)
    assert cache.n_evictable_pages == evictable
    held: dict[int, int] = {}
    for pages in holders:
        for p in pages.tolist():
            held[p] = held.get(p, 0) + 1
    in_tree = set(tree_pages)
    refcounts = alloc.refcount(torch.arange(1, alloc.n_pages)).tolist()
    for p, count in enumerate(refcounts, start=1):
        assert count == held.get(p, 0) + (p in in_tree), (p, count, held.get(p, 0), p in in_tree)
    assert alloc.n_free + len(set(held) | in_tree) == alloc.capacity


# ------------------------------------------------------------------------------ matching


def test_namespace_prefixes_match_only_in_their_namespace() -> None:
    alloc, cache = make(16, 2)
    t_a, t_base = seq(2, 2, 0), seq(2, 2, 100)
    p_a = cache_finished(alloc, cache, t_a, "a")
    p_base = cache_finished(alloc, cache, t_base)

    m = cache.match_prefix(t_a + [7], "a")
    assert (m.n_tokens, m.pages.tolist()) == (4, p_a.tolist())
    assert cache.match_prefix(t_a[:3], "a").pages.tolist() == p_a[:1].tolist()  # whole pages only
    for other in ("", "b"):
        miss = cache.match_prefix(t_a, other)
        assert miss.n_tokens == 0 and miss.pages.numel() == 0 and miss.pages.dtype == torch.int64
    assert cache.match_prefix(t_a).node is cache.root
    assert cache.match_prefix(t_a, "b").node is cache.root  # no root for "b": the tree's
    assert ns_key("b") not in cache.root.children, "a match must not create a namespace"

    m = cache.match_prefix(t_base)
    assert (m.n_tokens, m.pages.tolist()) == (4, p_base.tolist())
    for other in ("a", "b"):
        assert cache.match_prefix(t_base, other).n_tokens == 0
    # A miss in an existing namespace ends at that namespace's root.
    miss = cache.match_prefix(t_base, "a")
    assert miss.node is cache.root.children[ns_key("a")] and miss.node.namespace == "a"
    check_invariants(alloc, cache, [])


def test_same_tokens_in_several_namespaces_keep_separate_pages() -> None:
    alloc, cache = make(16, 2)
    tokens = seq(3, 2, 0)
    pages = {ns: take(alloc, 3) for ns in ("", "a", "b")}
    for ns, p in pages.items():
        assert cache.insert(tokens, p, ns) == 0, f"nothing of {ns!r} was cached before"
    assert cache.n_cached_pages == 9
    check_invariants(alloc, cache, list(pages.values()))  # each page: the request's and the tree's
    for ns, p in pages.items():
        assert cache.match_prefix(tokens, ns).pages.tolist() == p.tolist()

    # Re-inserting in one namespace finds it cached there and takes no reference on the duplicates.
    dup = take(alloc, 3)
    assert cache.insert(tokens, dup, "a") == 6
    assert alloc.refcount(dup).tolist() == [1, 1, 1]
    alloc.decref(dup)
    for p in pages.values():
        alloc.decref(p)
    check_invariants(alloc, cache, [])
    assert cache.n_cached_pages == cache.n_evictable_pages == 9


def test_split_inside_a_namespace_leaves_others_alone() -> None:
    alloc, cache = make(16, 2)
    x = seq(3, 2, 0)
    y = x[:3] + seq(2, 2, 50)[:3]  # diverges inside the second page
    px = cache_finished(alloc, cache, x, "a")
    pb = cache_finished(alloc, cache, x)
    py = take(alloc, 3)
    assert cache.insert(y, py, "a") == 2
    alloc.decref(py)

    ns_root = cache.root.children[ns_key("a")]
    assert list(ns_root.children) == [tuple(x[:2])]
    shared = ns_root.children[tuple(x[:2])]
    assert shared.pages.tolist() == px[:1].tolist() and len(shared.children) == 2
    assert cache.match_prefix(y, "a").pages.tolist() == [int(px[0]), *py[1:].tolist()]
    assert cache.match_prefix(x, "a").pages.tolist() == px.tolist()
    # The base namespace's copy of x was not split.
    base = cache.root.children[tuple(x[:2])]
    assert base.key == tuple(x) and base.pages.tolist() == pb.tolist()
    assert cache.match_prefix(y).pages.tolist() == pb[:1].tolist()
    check_invariants(alloc, cache, [])


# ------------------------------------------------------------------------------ locks and eviction


def test_eviction_is_lru_across_namespaces_and_drops_empty_roots() -> None:
    alloc, cache = make(16, 2)
    x, y, z, w = seq(1, 2, 0), seq(1, 2, 10), seq(1, 2, 20), seq(1, 2, 30)
    px = cache_finished(alloc, cache, x)
    py = cache_finished(alloc, cache, y, "a")
    pz = cache_finished(alloc, cache, z)
    pw = cache_finished(alloc, cache, w, "b")
    cache.match_prefix(x)  # x is now the most recently used
    assert cache.n_cached_pages == cache.n_evictable_pages == 4

    assert cache.evict(1) == 1
    assert alloc.is_free(int(py)) and cache.n_cached_pages == 3
    check_invariants(alloc, cache, [])
    # "a"'s emptied root (last used with y) is the oldest candidate now: it goes, then z.
    # (No match here: a match in "a" would refresh that root.)
    assert cache.evict(1) == 1
    assert alloc.is_free(int(pz)) and ns_key("a") not in cache.root.children
    assert cache.evict(1) == 1
    assert alloc.is_free(int(pw)) and not alloc.is_free(int(px))
    assert cache.evict(5) == 1
    assert alloc.is_free(int(px))
    assert cache.root.children == {}, "every namespace root emptied by evict is removed"
    assert cache.n_cached_pages == cache.n_evictable_pages == 0
    assert alloc.n_free == alloc.capacity
    for tokens, ns in ((x, ""), (y, "a"), (z, ""), (w, "b")):
        assert cache.match_prefix(tokens, ns).n_tokens == 0
    check_invariants(alloc, cache, [])


def test_evicting_a_whole_namespace_removes_its_root() -> None:
    alloc, cache = make(16, 2)
    x = seq(2, 2, 0)
    cache_finished(alloc, cache, x, "a")
    branch = take(alloc, 2)
    assert cache.insert(x[:2] + seq(1, 2, 40), branch, "a") == 2  # a second leaf under "a"
    alloc.decref(branch)
    keep_tokens = seq(1, 2, 90)
    keep = cache_finished(alloc, cache, keep_tokens)
    m = cache.match_prefix(keep_tokens)  # a running request locks the base leaf
    alloc.incref(m.pages)
    cache.lock(m.node)
    assert cache.n_cached_pages == 4 and cache.n_evictable_pages == 3

    assert cache.evict(100) == 3
    assert list(cache.root.children) == [tuple(keep_tokens)], "the emptied root of 'a' is removed"
    assert cache.match_prefix(keep_tokens).pages.tolist() == keep.tolist()
    assert cache.match_prefix(x, "a").n_tokens == 0
    assert cache.n_cached_pages == 1 and cache.n_evictable_pages == 0
    check_invariants(alloc, cache, [m.pages])
    cache.unlock(m.node)
    alloc.decref(m.pages)


def test_locked_namespace_root_is_not_evicted() -> None:
    alloc, cache = make(16, 2)
    cache_finished(alloc, cache, seq(2, 2, 0), "a")
    cache_finished(alloc, cache, seq(1, 2, 50))
    # A request in "a" whose prompt matches nothing there: it locks "a"'s root.
    miss = cache.match_prefix(seq(1, 2, 70), "a")
    ns_root = cache.root.children[ns_key("a")]
    assert miss.n_tokens == 0 and miss.node is ns_root
    cache.lock(miss.node)
    assert cache.n_evictable_pages == 3

    assert cache.evict(100) == 3
    assert cache.root.children == {ns_key("a"): ns_root} and ns_root.children == {}
    assert cache.n_cached_pages == cache.n_evictable_pages == 0
    check_invariants(alloc, cache, [])

    cache.unlock(miss.node)
    assert cache.evict(1) == 0  # no page left, but the unlocked empty root goes
    assert cache.root.children == {}
    check_invariants(alloc, cache, [])


def test_lock_inside_a_namespace_protects_its_path() -> None:
    alloc, cache = make(16, 2)
    tokens = seq(3, 2, 0)
    pa = cache_finished(alloc, cache, tokens, "a")
    pb = cache_finished(alloc, cache, tokens)
    m = cache.match_prefix(tokens[:4], "a")
    assert m.pages.tolist() == pa[:2].tolist()
    alloc.incref(m.pages)
    cache.lock(m.node)
    assert cache.n_evictable_pages == 4  # "a"'s last page and the base copy
    check_invariants(alloc, cache, [m.pages])

    assert cache.evict(100) == 4
    assert all(alloc.is_free(int(p)) for p in [pa[2], *pb])
    assert cache.match_prefix(tokens, "a").pages.tolist() == pa[:2].tolist()
    assert cache.n_cached_pages == 2 and cache.n_evictable_pages == 0
    check_invariants(alloc, cache, [m.pages])

    cache.unlock(m.node)
    assert cache.n_evictable_pages == 2
    assert cache.evict(100) == 0  # the request still holds both pages
    assert cache.root.children == {}
    check_invariants(alloc, cache, [m.pages])
    assert alloc.decref(m.pages) == 2
    assert alloc.n_free == alloc.capacity


def test_reset_drops_every_namespace() -> None:
    alloc, cache = make(16, 2)
    tokens = seq(2, 2, 0)
    for ns in ("", "a", "b"):
        cache_finished(alloc, cache, tokens, ns)
    m = cache.match_prefix(tokens, "b")
    alloc.incref(m.pages)
    cache.lock(m.node)
    check_invariants(alloc, cache, [m.pages])

    cache.reset()
    assert cache.root.children == {}
    assert cache.n_cached_pages == cache.n_evictable_pages == 0
    for ns in ("", "a", "b"):
        assert cache.match_prefix(tokens, ns).n_tokens == 0
    check_invariants(alloc, cache, [m.pages])
    cache.unlock(m.node)  # detached: a no-op
    alloc.decref(m.pages)
    assert alloc.n_free == alloc.capacity

    # The new tree's namespaces work as before.
    fresh = cache_finished(alloc, cache, tokens, "a")
    assert cache.match_prefix(tokens, "a").pages.tolist() == fresh.tolist()
    assert cache.match_prefix(tokens).n_tokens == 0
    check_invariants(alloc, cache, [])


# ------------------------------------------------------------------------------ randomised

NAMESPACES = ["", "a", "b"]


@dataclass
class Request:
    tokens: tuple[int, ...]
    namespace: str
    pages: list[int]
    node: RadixNode
    epoch: int


class NamespacedRadixMachine(RuleBasedStateMachine):
    """Requests in several namespaces sharing one small pool; ``content`` is what each page holds:
    (namespace, the tokens up to the end of the page), so a match across namespaces is caught."""

    @initialize(page_size=st.sampled_from([1, 2]), pool_tokens=st.integers(6, 24))
    def setup(self, page_size: int, pool_tokens: int) -> None:
        self.ps = page_size
        self.alloc, self.cache = make(1 + pool_tokens // page_size, page_size)
        self.requests: dict[int, Request] = {}
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.next_id = 0
        self.epoch = 0

    def cached(self) -> set[tuple[str, tuple[int, ...]]]:
        return {self.content[p] for node in tree_nodes(self.cache) for p in node.pages.tolist()}

    def check_match(self, tokens: tuple[int, ...], ns: str, pages: torch.Tensor, n_tokens: int) -> None:
        assert n_tokens == pages.numel() * self.ps <= len(tokens)
        for i, p in enumerate(pages.tolist()):
            assert self.content[p] == (ns, tokens[: (i + 1) * self.ps])
        nxt = n_tokens + self.ps
        if nxt <= len(tokens):
            assert (ns, tokens[:nxt]) not in self.cached(), "match is not maximal"

    def alloc_or_evict(self, n: int) -> torch.Tensor | None:
        pages = self.alloc.alloc(n)
        if pages is None:
            self.cache.evict(n - self.alloc.n_free)
            pages = self.alloc.alloc(n)
        return pages

    def release(self, rid: int, insert: bool) -> None:
        req = self.requests.pop(rid)
        if insert and req.epoch == self.epoch:
            full = len(req.tokens) // self.ps
            self.cache.insert(
                req.tokens[: full * self.ps], torch.tensor(req.pages[:full], dtype=torch.int64), req.namespace
            )
        self.alloc.decref(torch.tensor(req.pages, dtype=torch.int64))
        self.cache.unlock(req.node)

    @rule(tokens=token_seqs, ns=st.sampled_from(NAMESPACES), finish=st.booleans())
    def start(self, tokens: tuple[int, ...], ns: str, finish: bool) -> None:
        m = self.cache.match_prefix(tokens, ns)
        self.check_match(tokens, ns, m.pages, m.n_tokens)
        self.alloc.incref(m.pages)
        self.cache.lock(m.node)
        new = self.alloc_or_evict(-(-len(tokens) // self.ps) - m.pages.numel())
        if new is None:
            self.cache.unlock(m.node)
            self.alloc.decref(m.pages)
            return
        pages = m.pages.tolist() + new.tolist()
        for i in range(m.pages.numel(), len(pages)):
            self.content[pages[i]] = (ns, tokens[: (i + 1) * self.ps])
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests[rid] = Request(tokens, ns, pages, m.node, self.epoch)
        if finish:
            self.release(rid, insert=True)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data: st.DataObject, insert: bool) -> None:
        self.release(data.draw(st.sampled_from(sorted(self.requests))), insert)

    @rule(tokens=token_seqs, ns=st.sampled_from(NAMESPACES))
    def lookup(self, tokens: tuple[int, ...], ns: str) -> None:
        m = self.cache.match_prefix(tokens, ns)
        self.check_match(tokens, ns, m.pages, m.n_tokens)

    @rule(n=st.integers(1, 8))
    def evict(self, n: int) -> None:
        free_before = self.alloc.n_free
        freed = self.cache.evict(n)
        assert freed == self.alloc.n_free - free_before
        if freed < n:  # everything evictable went, empty namespace roots included
            assert self.cache.n_evictable_pages == 0
            assert all(node.lock_count > 0 for node in tree_nodes(self.cache)[1:])

    @precondition(lambda self: self.cache.n_cached_pages > 0)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.epoch += 1
        assert self.cache.root.children == {}

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        live = [r for r in self.requests.values() if r.epoch == self.epoch]
        for req in live:
            node: RadixNode | None = req.node
            while node is not None and node is not self.cache.root:
                node = node.parent
            assert node is self.cache.root, "a locked node left the live tree"
        expected_locks: dict[int, int] = {}
        for req in live:
            walk: RadixNode | None = req.node
            while walk is not None:
                expected_locks[id(walk)] = expected_locks.get(id(walk), 0) + 1
                walk = walk.parent
        for node in tree_nodes(self.cache):
            assert node.lock_count == expected_locks.get(id(node), 0)
        check_invariants(
            self.alloc, self.cache, [torch.tensor(r.pages, dtype=torch.int64) for r in self.requests.values()]
        )

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid in sorted(self.requests):
            self.release(rid, insert=True)
        self.consistent()
        self.cache.reset()
        assert self.alloc.n_free == self.alloc.capacity


TestNamespacedRadixMachine = NamespacedRadixMachine.TestCase
TestNamespacedRadixMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


# ------------------------------------------------------------------------------ through CacheManager


def make_manager(page_size: int, n_pages: int, rows: int = 4, context: int = 64) -> CacheManager:
    config = EngineConfig(page_size=page_size, max_running_requests=rows)
    return CacheManager(config, n_pages * page_size, ReqToTokenPool(rows, context, "cpu"))


def test_manager_namespace_isolates_prefixes_and_fork_keeps_it() -> None:
    mgr = make_manager(page_size=2, n_pages=32)
    assert mgr.radix is not None
    tokens = list(range(9))  # four full pages and one token

    base = KVHandle()
    assert mgr.alloc(base, tokens) and mgr.extend(base, len(tokens)) is not None
    mgr.free(base, tokens)  # its four full pages stay cached for the base model
    hits = mgr.stats.prefix_hit_tokens

    lora = KVHandle()
    assert mgr.alloc(lora, tokens, namespace="a")
    assert (lora.n_kv, lora.n_cached_tokens, lora.namespace) == (0, 0, "a")
    assert mgr.stats.prefix_hit_tokens == hits, "the base model's prefix is no hit for another namespace"
    assert mgr.extend(lora, len(tokens)) is not None

    control = KVHandle()
    assert mgr.alloc(control, tokens)
    assert control.n_kv == control.n_cached_tokens == 8 and control.namespace == ""
    mgr.free(control, tokens, cache_pages=False)

    child = KVHandle()
    copies = mgr.fork(lora, child)
    assert copies is not None and child.namespace == "a" and child.n_kv == lora.n_kv
    mgr.free(child, tokens)  # caches the shared full pages in "a"
    lora_pages = mgr.radix.match_prefix(tokens, "a").pages
    base_pages = mgr.radix.match_prefix(tokens).pages
    assert lora_pages.numel() == base_pages.numel() == 4
    assert set(lora_pages.tolist()).isdisjoint(base_pages.tolist()), "each namespace keeps its own pages"
    assert lora_pages.tolist() == mgr._row_pages(lora.row, 8).tolist()

    again = KVHandle()
    assert mgr.alloc(again, tokens, namespace="a") and again.n_kv == 8
    other = KVHandle()
    assert mgr.alloc(other, tokens, namespace="b") and other.n_kv == 0
    for kv in (lora, again, other):
        mgr.free(kv, tokens)
    check_invariants(mgr.allocator, mgr.radix, [])

    mgr.reset_prefix_cache()
    assert mgr.radix.root.children == {} and mgr.allocator.n_free == mgr.allocator.capacity
