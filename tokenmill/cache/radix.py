"""Radix tree over token ids, at page granularity, for sharing KV-cache prefixes."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.cache.allocator import PageAllocator


class RadixNode:
    """One edge of the radix tree: a run of whole pages of tokens.

    ``key`` holds ``len(pages) * page_size`` token ids and ``pages`` the KV
    pages that store them. ``children`` is keyed by the tuple of each child's
    first page of tokens, so siblings always differ within their first page.
    ``lock_count`` counts the ``lock`` calls on this node or its descendants
    that have not been undone; a node with ``lock_count > 0`` is never evicted.
    ``last_access`` is the cache's logical clock at the last match or insert
    through this node, ``serial`` breaks LRU ties, and ``epoch`` is the tree
    generation the node belongs to (``RadixCache.reset`` starts a new one).
    The root has an empty key and no pages; so has each namespace's root
    (``namespace`` set), a child of the root under the key ``("namespace", name)``.
    """

    __slots__ = (
        "namespace",
        "key",
        "pages",
        "parent",
        "children",
        "lock_count",
        "last_access",
        "epoch",
        "serial",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        pages: torch.Tensor,
        parent: RadixNode | None,
        epoch: int,
        serial: int,
        namespace: str | None = None,
    ) -> None:
        self.namespace = namespace
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_count = 0
        self.last_access = 0
        self.epoch = epoch
        self.serial = serial

    @property
    def n_pages(self) -> int:
        """Number of pages stored in this node."""
        return self.pages.numel()


@dataclass(frozen=True)
class PrefixMatch:
    """Result of ``RadixCache.match_prefix``.

    ``pages`` (int64) store the first ``n_tokens == len(pages) * page_size``
    tokens; ``node`` is the deepest matched node (the root if nothing matched).
    """

    pages: torch.Tensor
    n_tokens: int
    node: RadixNode


class RadixCache:
    """Prefix cache mapping token sequences to KV pages of a ``PageAllocator``.

    Reference invariant: a page's refcount equals the number of live requests
    holding it plus 1 if the tree stores it. The tree holds exactly one
    reference on each page stored in it, and each page is stored at most once.

    Namespaces: tokens cached under one namespace (e.g. a LoRA adapter's version) are matched
    only under that namespace; ``""`` is the base model's, the tree's own root. Each other
    namespace has a root of its own below the tree's root, made on first insert and evicted like a
    leaf once it holds nothing.

    Only whole pages are cached and matched. Recency is a logical clock bumped
    by every ``match_prefix`` and ``insert``. Not thread-safe: the single
    engine thread owns the cache.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        """Create an empty cache over ``allocator``'s pages (page size taken from it)."""
        self._allocator = allocator
        self._page_size = allocator.page_size
        self._clock = 0
        self._epoch = 0
        self._serials = itertools.count()
        self._root = self._new_node((), torch.empty(0, dtype=torch.int64), None)
        self._n_cached_pages = 0
        self._n_locked_pages = 0

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def root(self) -> RadixNode:
        """Root of the live tree (empty key, no pages)."""
        return self._root

    @property
    def n_cached_pages(self) -> int:
        """Pages stored in the tree."""
        return self._n_cached_pages

    @property
    def n_evictable_pages(self) -> int:
        """Pages stored in unlocked nodes (freed by eviction unless a request also holds them)."""
        return self._n_cached_pages - self._n_locked_pages

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> PrefixMatch:
        """Find the longest cached whole-page prefix of ``tokens`` in ``namespace``.

        Refreshes the recency of the matched path and splits a node matched
        only partly, so that ``node`` covers exactly the matched pages. Does
        not incref or lock: the caller increfs ``pages`` for its request and
        calls ``lock(node)``. May match all of ``tokens``; leaving at least one
        token to compute is the caller's job.
        """
        ps = self._page_size
        tokens = tuple(tokens)
        now = self._tick()
        node = self._namespace_root(namespace, create=False)
        if node is None:
            return PrefixMatch(pages=torch.empty(0, dtype=torch.int64), n_tokens=0, node=self._root)
        node.last_access = now
        matched: list[torch.Tensor] = []
        pos = 0
        while pos < len(tokens):
            # A trailing partial page never equals a child's full first page.
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            n = _common_prefix_len(child.key, tokens, pos) // ps * ps
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            matched.append(child.pages)
            node = child
            pos += n
        pages = torch.cat(matched) if matched else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(pages=pages, n_tokens=pos, node=node)

    def insert(self, tokens: Sequence[int], pages: torch.Tensor, namespace: str = "") -> int:
        """Cache ``tokens`` stored in ``pages`` in ``namespace``; return how many tokens were already cached.

        ``pages`` is a 1-D int64 tensor and ``len(tokens)`` must equal
        ``len(pages) * page_size`` (ValueError otherwise). Where the tree
        already holds a prefix it keeps its own pages, and the caller's pages
        for that part stay the caller's to decref. The remaining pages are
        stored in a new leaf and incref'd for the tree; they must be allocated
        and not already stored in the tree.
        """
        ps = self._page_size
        tokens = tuple(tokens)
        if pages.dim() != 1 or pages.dtype != torch.int64:
            raise ValueError(f"pages must be a 1-D int64 tensor, got shape {tuple(pages.shape)} dtype {pages.dtype}")
        if len(tokens) != pages.numel() * ps:
            raise ValueError(
                f"insert needs len(tokens) == len(pages) * page_size, got {len(tokens)} "
                f"tokens, {pages.numel()} pages, page_size {ps}"
            )
        now = self._tick()
        node = self._namespace_root(namespace, create=True)
        node.last_access = now
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                new_pages = pages[pos // ps :].clone()
                self._allocator.incref(new_pages)
                leaf = self._new_node(tokens[pos:], new_pages, node)
                leaf.last_access = now
                node.children[leaf.key[:ps]] = leaf
                self._n_cached_pages += leaf.n_pages
                break
            n = _common_prefix_len(child.key, tokens, pos) // ps * ps
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node = child
            pos += n
        return pos

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction until ``unlock(node)``.

        ``node`` must be in the live tree (RuntimeError if it was evicted or
        detached by ``reset``).
        """
        if node.epoch != self._epoch or (node is not self._root and node.parent is None):
            raise RuntimeError("cannot lock a node that is no longer in the tree")
        walk: RadixNode | None = node
        while walk is not None:
            if walk.lock_count == 0:
                self._n_locked_pages += walk.n_pages
            walk.lock_count += 1
            walk = walk.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``.

        A no-op for nodes detached by ``reset``. Unlocking a live node that is
        not locked raises RuntimeError.
        """
        if node.epoch != self._epoch:
            return
        if node.lock_count <= 0:
            raise RuntimeError("unlock of a node that is not locked")
        walk: RadixNode | None = node
        while walk is not None:
            walk.lock_count -= 1
            if walk.lock_count == 0:
                self._n_locked_pages -= walk.n_pages
            walk = walk.parent

    def evict(self, n_pages: int) -> int:
        """Evict least-recently-used unlocked leaves until ``n_pages`` pages are freed.

        Drops the tree's reference on each evicted node's pages; a parent
        becomes a candidate once its last child is gone. Stops early when
        nothing evictable is left. Returns the number of pages that actually
        became free in the allocator (pages still held by requests do not
        count), which may exceed ``n_pages``. Costs O(tree nodes) to find the
        candidates plus O(log) per evicted node.
        """
        freed = 0
        if n_pages <= 0:
            return freed
        heap = [(leaf.last_access, leaf.serial, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        while freed < n_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf)]
            leaf.parent = None
            self._n_cached_pages -= leaf.n_pages
            freed += self._allocator.decref(leaf.pages)
            if parent is not self._root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        return freed

    def reset(self) -> None:
        """Drop the whole tree, decref'ing every page it stores.

        Nodes still locked by requests are detached: their pages stay alive
        through the requests' own references, and their later ``unlock`` is a
        no-op.
        """
        held = [node.pages for node in self._nodes() if node is not self._root]
        if held:
            self._allocator.decref(torch.cat(held))
        self._epoch += 1
        self._root = self._new_node((), torch.empty(0, dtype=torch.int64), None)
        self._n_cached_pages = 0
        self._n_locked_pages = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(
        self, key: tuple[int, ...], pages: torch.Tensor, parent: RadixNode | None, namespace: str | None = None
    ) -> RadixNode:
        return RadixNode(key, pages, parent, self._epoch, next(self._serials), namespace)

    def _namespace_root(self, namespace: str, create: bool) -> RadixNode | None:
        """The node ``namespace``'s keys start below (the tree's root for ``""``); None if it has
        none and ``create`` is false."""
        if not namespace:
            return self._root
        key = ("namespace", namespace)
        node = self._root.children.get(key)  # type: ignore[call-overload]
        if node is None and create:
            node = self._new_node((), torch.empty(0, dtype=torch.int64), self._root, namespace)
            self._root.children[key] = node  # type: ignore[index]
        return node

    def _child_key(self, node: RadixNode) -> tuple:
        """``node``'s key in its parent's ``children``."""
        return ("namespace", node.namespace) if node.namespace is not None else node.key[: self._page_size]

    def _split(self, node: RadixNode, n_tokens: int) -> RadixNode:
        """Split ``node`` after its first ``n_tokens`` tokens (a whole number of pages, > 0).

        The new upper node takes over ``node``'s place under its parent; ``node``
        keeps the tail, its children, and its identity (so existing locks on it
        still unlock the right path). Both parts keep ``node``'s lock count.
        """
        ps = self._page_size
        parent = node.parent
        assert parent is not None and 0 < n_tokens < len(node.key) and n_tokens % ps == 0
        upper = self._new_node(node.key[:n_tokens], node.pages[: n_tokens // ps], parent)
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        parent.children[upper.key[:ps]] = upper
        node.key = node.key[n_tokens:]
        node.pages = node.pages[n_tokens // ps :]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    def _nodes(self) -> list[RadixNode]:
        """All nodes of the live tree, root first."""
        out = [self._root]
        i = 0
        while i < len(out):
            out.extend(out[i].children.values())
            i += 1
        return out

    def _evictable_leaves(self) -> list[RadixNode]:
        return [node for node in self._nodes() if node is not self._root and not node.children and node.lock_count == 0]


def _common_prefix_len(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[start:]``."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start : start + n]:
        return n
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i
