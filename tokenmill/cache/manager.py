"""CacheManager: gives sequences KV slots and shares prefixes (cache layer 2 and the pages of layer 1).

Each sequence is represented by its :class:`KVHandle` (written only here) and, where the radix
cache needs them, its token ids (prompt then output, passed in). Ownership: a handle's positions
``0 .. n_kv-1`` have slots recorded in its request-to-token row. Every page a row points at
carries one reference for that handle; the radix cache holds one more on the pages it stores.
All methods run on the engine thread only. The KV storage itself, and the views each step binds
over it, belong to the model worker (``worker/model_worker.py``); the manager knows only how many
slots there are.

Epochs: ``reset_prefix_cache`` (e.g. after a weight update) starts a new epoch; a handle
admitted in an older epoch never inserts its KV into the radix cache, so no later request can
reuse KV computed under old weights.

The second tier (optional, ``cache/kv_tier.py``: host memory, disk, or host memory in front of
disk) is reached through :class:`~tokenmill.cache.tier_moves.TierMoves`: whole blocks of a prefix
that enter the radix cache are queued to be saved, and an admission whose device match ends where
the tier holds the next blocks loads them instead of computing them (when reading is measured
faster than prefill). The manager never touches KV data: ``take_tier_moves`` hands the step
(``cache/tier_mover.py``) the slots to save from and the blocks to store into freshly allocated slots. A handle's
positions waiting for a load count as computed, except that nothing caches them before the load
is applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tokenmill.cache.allocator import PageAllocator
from tokenmill.cache.handle import KVHandle
from tokenmill.cache.kv_tier import KVTier
from tokenmill.cache.radix import RadixCache
from tokenmill.cache.storage import ReqToTokenPool
from tokenmill.cache.tier_moves import TierLoad, TierMoves
from tokenmill.config.cache import CacheOptions


@dataclass
class CacheStats:
    """Counters for metrics and tests."""

    prefix_queries: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0


class CacheManager:
    def __init__(
        self, config: CacheOptions, n_slots: int, req_pool: ReqToTokenPool, tier: KVTier | None = None
    ) -> None:
        """``n_slots``: the KV storage's slots (``n_slots // page_size`` pages); ``req_pool``: layer 2;
        ``tier``: the second tier (needs the radix cache; its blocks a whole number of pages)."""
        self.config = config
        self.page_size = config.page_size
        self.req_pool = req_pool
        self.allocator = PageAllocator(n_slots // self.page_size, self.page_size)
        self.radix = RadixCache(self.allocator) if config.enable_prefix_caching else None
        self.stats = CacheStats()
        self.epoch = 0
        assert tier is None or (self.radix is not None and tier.block_tokens % self.page_size == 0)
        self.tier = tier
        self._tier_moves = TierMoves(tier, req_pool)

    # ----------------------------------------------------------------- capacity
    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    def available_pages(self) -> int:
        """Pages obtainable now: free ones plus those only the radix cache holds (evictable)."""
        evictable = self.radix.n_evictable_pages if self.radix is not None else 0
        return self.allocator.n_free + evictable

    def pages_needed(self, kv: KVHandle, n_tokens: int) -> int:
        """New pages needed for ``kv`` to hold ``n_tokens`` more positions."""
        held = -(-kv.n_kv // self.page_size)
        return -(-(kv.n_kv + n_tokens) // self.page_size) - held

    def usage(self) -> tuple[float, float]:
        """``(live, prefix_cache_only)``: the fractions of the pages held by live sequences (a page the
        prefix cache also stores counts once) and of those only the prefix cache holds (no live
        sequence uses them; eviction frees them). Walks the prefix tree once."""
        reclaimable, capacity = self.n_reclaimable_pages(), self.allocator.capacity
        return (self.allocator.n_used - reclaimable) / capacity, reclaimable / capacity

    def n_reclaimable_pages(self) -> int:
        """Pages that only the prefix cache holds (refcount 1, the tree's own reference). Walks the tree."""
        if self.radix is None:
            return 0
        nodes = [self.radix.root]
        for node in nodes:  # grows while iterated: breadth-first over the tree
            nodes.extend(node.children.values())
        pages = torch.cat([node.pages for node in nodes])
        return int((self.allocator.refcount(pages) == 1).sum()) if pages.numel() else 0

    def snapshot(self) -> dict[str, Any]:
        """Counters and occupancy for metrics: ``cache`` (the :class:`CacheStats`), ``kv_usage`` (pages
        of live sequences), ``kv_prefix_cache_usage`` (pages only the prefix cache holds), free,
        capacity and cached pages, free request rows, the host and disk tiers' counters (None without them).
        Walks the prefix tree once."""
        live_usage, prefix_cache_usage = self.usage()
        tiers = self.tier.snapshots() if self.tier is not None else {}
        return {
            "cache": asdict(self.stats),
            "kv_usage": live_usage,
            "kv_prefix_cache_usage": prefix_cache_usage,
            "kv_free_pages": self.allocator.n_free,
            "kv_capacity_pages": self.allocator.capacity,
            "kv_cached_pages": self.radix.n_cached_pages if self.radix is not None else 0,
            "free_rows": self.req_pool.n_free,
            "host_tier": tiers.get("host"),
            "disk_tier": tiers.get("disk"),
        }

    # ----------------------------------------------------------------- lifecycle
    def alloc(self, kv: KVHandle, tokens: Sequence[int], use_prefix_cache: bool = True, namespace: str = "") -> bool:
        """Give ``kv`` a row and the cached prefix of ``tokens`` (the sequence's token ids) in
        ``namespace`` (KV computed with other weights, e.g. a LoRA adapter's: ``""`` is the base
        model's; only the base model's prefixes go to the second tier). All or nothing: False leaves
        nothing allocated.

        The prefix match is capped so at least one token remains to compute (the step that
        computes it yields the logits for the next token). ``use_prefix_cache=False`` matches
        nothing: every token is computed (e.g. for its logits).
        """
        assert kv.row is None, "handle already holds a row"
        row = self.req_pool.alloc()
        if row is None:
            return False
        kv.row, kv.n_kv, kv.n_cached_tokens, kv.epoch, kv.namespace = row, 0, 0, self.epoch, namespace
        if self.radix is not None and use_prefix_cache:
            tokens = tokens[:-1]
            match = self.radix.match_prefix(tokens, namespace)
            self.stats.prefix_queries += 1
            self.stats.prefix_query_tokens += len(tokens)
            self.stats.prefix_hit_tokens += match.n_tokens
            if match.n_tokens:
                self.allocator.incref(match.pages)
                self.req_pool.write(row, 0, self.allocator.slots_of(match.pages))
                kv.n_kv = kv.n_cached_tokens = match.n_tokens
            self.radix.lock(match.node)
            kv.prefix_node = match.node
            if self.tier is not None and not namespace:
                self._tier_moves.load(kv, tokens, self.epoch, self.extend)
        return True

    def extend(self, kv: KVHandle, n_tokens: int) -> torch.Tensor | None:
        """Slots for positions ``n_kv .. n_kv+n_tokens-1`` (recorded in the row, ``n_kv`` advanced).

        Allocates pages as needed, evicting unreferenced cached pages first. Returns None and
        changes nothing when the pages cannot be had.
        """
        assert kv.row is not None and n_tokens >= 1
        start, ps = kv.n_kv, self.page_size
        if start + n_tokens > self.req_pool.max_context_len:
            raise ValueError(f"sequence would exceed max_context_len {self.req_pool.max_context_len}")
        new_pages = self._alloc_pages(self.pages_needed(kv, n_tokens))
        if new_pages is None:
            return None
        positions = torch.arange(start, start + n_tokens)
        if start % ps:  # the last page is partly filled: continue in it
            last_page = int(self.req_pool.table[kv.row, start - 1]) // ps
            new_pages = torch.cat([torch.tensor([last_page]), new_pages])
        pages = new_pages[positions // ps - start // ps]
        slots = pages * ps + positions % ps
        self.req_pool.write(kv.row, start, slots)
        kv.n_kv = start + n_tokens
        return slots

    def extend_decode(self, kvs: list[KVHandle]) -> torch.Tensor | None:
        """One new slot for each handle (a decode step), or None with nothing changed."""
        ps = self.page_size
        need_page = [s.n_kv % ps == 0 for s in kvs]
        new_pages = self._alloc_pages(sum(need_page))
        if new_pages is None:
            return None
        rows = torch.tensor([s.row for s in kvs])
        starts = torch.tensor([s.n_kv for s in kvs])
        if ps == 1:
            slots = new_pages
        else:
            need = torch.tensor(need_page)
            prev_slot = self.req_pool.table[rows, (starts - 1).clamp(min=0)].long()
            page = prev_slot // ps
            page[need] = new_pages
            slots = page * ps + starts % ps
        self.req_pool.write_positions(rows, starts, slots)
        for s in kvs:
            s.n_kv += 1
        return slots

    def truncate(self, kv: KVHandle, n_kv: int) -> None:
        """Keep positions ``0 .. n_kv-1`` (``n_kv <= kv.n_kv``) and release the pages wholly past
        them (a speculative step's rejected proposals: a length change, nothing copied)."""
        assert kv.row is not None and 0 <= n_kv <= kv.n_kv
        held = self._row_pages(kv.row, kv.n_kv)
        kept = -(-n_kv // self.page_size)
        if held.numel() > kept:
            self.allocator.decref(held[kept:])
        kv.n_kv = n_kv

    def cache_prompt(self, kv: KVHandle, tokens: Sequence[int]) -> None:
        """Share the computed full pages of ``kv`` (holding ``tokens``) through the radix cache
        while its sequence keeps running.

        Where the tree already holds identical pages (computed by another sequence), ``kv``
        switches to the tree's pages and releases its duplicates.
        """
        if self.radix is None or kv.row is None or kv.epoch != self.epoch:
            return
        n_full = kv.n_kv // self.page_size * self.page_size
        if n_full == 0:
            return
        tokens = tokens[:n_full]
        own_pages = self._row_pages(kv.row, n_full)
        self.radix.insert(tokens, own_pages, kv.namespace)
        match = self.radix.match_prefix(tokens, kv.namespace)
        dup = match.pages != own_pages
        if bool(dup.any()):
            self.allocator.incref(match.pages[dup])
            self.allocator.decref(own_pages[dup])
            self.req_pool.write(kv.row, 0, self.allocator.slots_of(match.pages))
        self.radix.lock(match.node)
        if kv.prefix_node is not None:
            self.radix.unlock(kv.prefix_node)
        kv.prefix_node = match.node
        self._tier_moves.save(kv, tokens, self.epoch)

    def fork(self, parent: KVHandle, child: KVHandle) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Give ``child`` (holding nothing) ``parent``'s positions ``0 .. n_kv-1``: a row that shares
        its full pages and a page of its own for the partial last one. All or nothing: None leaves
        nothing allocated.

        Returns the partial page's (source, destination) slots: their K/V are copied (the step's
        fork copies, ``KVStorage.copy_slots``) once ``parent``'s KV there is computed (it may be
        computed in a step still to run), before either sequence writes past ``n_kv``. The child
        inserts into the radix cache only if the parent would (same epoch).
        """
        assert child.row is None and parent.row is not None
        n, ps = parent.n_kv, self.page_size
        n_full = n // ps * ps
        row = self.req_pool.alloc()
        if row is None:
            return None
        own_page = self._alloc_pages(1 if n > n_full else 0)
        if own_page is None:
            self.req_pool.free(row)
            return None
        shared = self._row_pages(parent.row, n_full)
        if shared.numel():
            self.allocator.incref(shared)
        slots = self.req_pool.table[parent.row, :n].long().cpu()
        copies = self.allocator.slots_of(own_page)[: n - n_full]
        self.req_pool.write(row, 0, torch.cat([slots[:n_full], copies]))
        child.row, child.n_kv, child.n_cached_tokens, child.epoch = row, n, n, parent.epoch
        child.namespace = parent.namespace
        return slots[n_full:], copies

    def free(self, kv: KVHandle, tokens: Sequence[int], cache_pages: bool = True) -> None:
        """Release the row and page references of ``kv`` (holding ``tokens``); with
        ``cache_pages`` its computed full pages of ``tokens`` stay in the radix cache for later prefix
        hits (positions past ``tokens``, a speculative step's proposals, never do)."""
        if kv.row is None:
            return
        computed = min(kv.n_kv, len(tokens), self._tier_moves.drop_loads(kv))
        n_full = computed // self.page_size * self.page_size
        pages = self._row_pages(kv.row, kv.n_kv)
        if self.radix is not None:
            if cache_pages and n_full and kv.epoch == self.epoch:
                self.radix.insert(tokens[:n_full], pages[: n_full // self.page_size], kv.namespace)
                self._tier_moves.save(kv, tokens[:n_full], self.epoch)
            if kv.prefix_node is not None:
                self.radix.unlock(kv.prefix_node)
        if pages.numel():
            self.allocator.decref(pages)
        self.req_pool.free(kv.row)
        kv.row, kv.n_kv, kv.prefix_node = None, 0, None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix of the device (e.g. after a weight update). Running sequences
        keep theirs; nothing computed before joins the second tier."""
        if self.radix is not None:
            self.radix.reset()
        self._tier_moves.forget_saves()
        self.epoch += 1

    def clear_tiers(self) -> None:
        """Forget every cached prefix, on the device and in the second tier."""
        self.reset_prefix_cache()
        if self.tier is not None:
            self.tier.clear()

    def rename_tier(self, namespace: str) -> None:
        """The weights changed: the second tier serves ``namespace`` from now on (its blocks deleted)."""
        if self.tier is not None:
            self._tier_moves.forget_saves()
            self.tier.renamespace(namespace)

    # ----------------------------------------------------------------- second tier
    def take_tier_moves(self) -> tuple[list[tuple[str, torch.Tensor]], list[TierLoad]]:
        """``(saves, loads)`` queued since the last call: blocks to save (name, the slots holding them
        now) and blocks read for new slots. Saves must be read before loads are stored, both before
        the next forward."""
        return self._tier_moves.take()

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        """A forward computed ``n_tokens`` prompt tokens in ``seconds``: the speed loading competes with."""
        self._tier_moves.observe_prefill(n_tokens, seconds)

    def tier_load_pays(self) -> bool:
        """Whether loading a token's KV from the tier is faster than computing it (True until both are measured)."""
        return self._tier_moves.load_pays()

    # ----------------------------------------------------------------- internals
    def _alloc_pages(self, n: int) -> torch.Tensor | None:
        pages = self.allocator.alloc(n)
        if pages is None and self.radix is not None:
            self.radix.evict(n - self.allocator.n_free)
            pages = self.allocator.alloc(n)
        return pages

    def _row_pages(self, row: int, n_tokens: int) -> torch.Tensor:
        """Distinct pages holding positions ``0 .. n_tokens-1`` of ``row``, in order."""
        slots = self.req_pool.table[row, : n_tokens : self.page_size].long()
        return slots // self.page_size
