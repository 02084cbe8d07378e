"""CacheManager invariants under random operation sequences, steady-state decode safety,
and prefix sharing through the real model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.tiny_models import save_tiny_model
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.handle import KVHandle
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.storage import KVStorage, ReqToTokenPool
from tokenmill.cache.view_binder import ViewBinder
from tokenmill.config import EngineConfig
from tokenmill.model.loader import load_model


def make_manager(page_size: int, n_pages: int, rows: int = 4, context: int = 64, **cfg) -> CacheManager:
    config = EngineConfig(page_size=page_size, max_running_requests=rows, **cfg)
    return CacheManager(config, n_pages * page_size, ReqToTokenPool(rows, context, "cpu"))


@dataclass(eq=False)
class Seq:
    """What the cache sees of a sequence: its handle and its token ids (prompt, then output)."""

    tokens: list[int]
    kv: KVHandle = field(default_factory=KVHandle)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_kv(self) -> int:
        return self.kv.n_kv

    @property
    def row(self) -> int | None:
        return self.kv.row


def new_seq(tokens: list[int]) -> Seq:
    return Seq(list(tokens))


class ManagerMachine(RuleBasedStateMachine):
    """Random alloc / extend / decode / cache / free / evict / reset; the model of KV content is a
    shadow map slot -> token written whenever a slot is handed out for a position."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), n_pages=st.integers(4, 14))
    def setup(self, page_size: int, n_pages: int) -> None:
        self.ps = page_size
        self.mgr = make_manager(page_size, n_pages)
        self.live: list[Seq] = []
        self.shadow: dict[int, int] = {}

    def _record(self, seq: Seq, slots: torch.Tensor) -> None:
        start = seq.n_kv - slots.numel()
        for i, slot in enumerate(slots.tolist()):
            self.shadow[slot] = seq.tokens[start + i]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def start(self, tokens: list[int]) -> None:
        seq = new_seq(tokens)
        if not self.mgr.alloc(seq.kv, seq.tokens):
            return
        slots = self.mgr.extend(seq.kv, seq.n_tokens - seq.n_kv)
        if slots is None:  # all or nothing: give everything back
            self.mgr.free(seq.kv, seq.tokens, cache_pages=False)
            return
        self._record(seq, slots)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if seq.n_tokens >= 60:
            return
        seq.tokens.append(token)
        slots = self.mgr.extend_decode([seq.kv])
        if slots is None:
            seq.tokens.pop()
            return
        self._record(seq, slots)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """An n > 1 sibling: the parent's full pages shared, its partial last page copied."""
        parent = data.draw(st.sampled_from(self.live))
        child = new_seq(parent.tokens)
        copies = self.mgr.fork(parent.kv, child.kv)
        if copies is None:
            return
        src, dst = copies  # the step's fork copies: the slots' content follows
        for s, d in zip(src.tolist(), dst.tolist()):
            self.shadow[d] = self.shadow[s]
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_prompt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.mgr.cache_prompt(seq.kv, seq.tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), cache=st.booleans())
    def finish(self, data: st.DataObject, cache: bool) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.mgr.free(seq.kv, seq.tokens, cache_pages=cache)

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        if self.mgr.radix is not None:
            self.mgr.radix.evict(n)

    @rule()
    def reset(self) -> None:
        self.mgr.reset_prefix_cache()

    @invariant()
    def pages_are_free_xor_held_and_refcounts_match(self) -> None:
        mgr, ps = self.mgr, self.ps
        holders: Counter[int] = Counter()
        table = mgr.req_pool.table
        for seq in self.live:
            pages = set((table[seq.row, : seq.n_kv].long() // ps).tolist())
            holders.update(pages)
        tree_pages = [p for node in mgr.radix._nodes() for p in node.pages.tolist()]
        assert len(tree_pages) == len(set(tree_pages)), "a page is stored twice in the tree"
        holders.update(tree_pages)
        alloc = mgr.allocator
        for page in range(1, alloc.n_pages):
            count = int(alloc.refcount(torch.tensor([page]))[0])
            assert count == holders[page], f"page {page}: refcount {count}, holders {holders[page]}"
            assert alloc.is_free(page) == (count == 0)
        assert alloc.n_free + alloc.n_used == alloc.capacity

    @invariant()
    def usage_counts_live_pages_and_the_prefix_cache_the_rest(self) -> None:
        """``usage``: the pages live sequences hold (like vLLM's gauge); ``prefix_cache_usage``: the
        pages only the tree holds, which eviction would free."""
        mgr, ps = self.mgr, self.ps
        live = {p for seq in self.live for p in (mgr.req_pool.table[seq.row, : seq.n_kv].long() // ps).tolist()}
        tree = {p for node in mgr.radix._nodes() for p in node.pages.tolist()}
        capacity = mgr.allocator.capacity
        assert mgr.usage() == (len(live) / capacity, len(tree - live) / capacity)

    @invariant()
    def rows_map_exactly_their_tokens(self) -> None:
        table = self.mgr.req_pool.table
        live_rows = {seq.row for seq in self.live}
        assert len(live_rows) == len(self.live)
        for seq in self.live:
            slots = table[seq.row, : seq.n_kv].tolist()
            assert [self.shadow[s] for s in slots] == seq.tokens[: seq.n_kv]
            assert all(s % self.ps == pos % self.ps for pos, s in enumerate(slots))
            assert not table[seq.row, seq.n_kv :].any(), "stale entries beyond n_kv"
        for row in set(range(table.shape[0])) - live_rows:
            assert not table[row].any(), f"free row {row} holds a stale mapping"

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for seq in self.live:
            self.mgr.free(seq.kv, seq.tokens)
        self.mgr.reset_prefix_cache()
        assert self.mgr.allocator.n_free == self.mgr.allocator.capacity, "pages leaked"
        assert self.mgr.req_pool.n_free == self.mgr.req_pool.max_rows, "rows leaked"


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_alloc_is_all_or_nothing_when_rows_run_out() -> None:
    mgr = make_manager(1, 16, rows=1)
    first, second = new_seq([1, 2, 3]), new_seq([1, 2, 3])
    assert mgr.alloc(first.kv, first.tokens)
    free_before = mgr.allocator.n_free
    assert not mgr.alloc(second.kv, second.tokens)
    assert second.row is None and mgr.allocator.n_free == free_before


def test_full_pool_evicts_only_unreferenced_cache(tmp_path: Path) -> None:
    mgr = make_manager(2, 9, rows=4)  # 8 usable pages of 2 slots
    done = new_seq([1, 1, 1, 1, 0, 0])
    assert mgr.alloc(done.kv, done.tokens)
    mgr.extend(done.kv, 6)
    mgr.free(done.kv, done.tokens)  # its 3 pages stay in the cache, unreferenced
    running = new_seq([2, 2, 2, 2])
    assert mgr.alloc(running.kv, running.tokens)
    held = mgr.extend(running.kv, 4)
    assert mgr.allocator.n_free == 3
    big = new_seq([0] * 10)
    assert mgr.alloc(big.kv, big.tokens)
    assert mgr.extend(big.kv, 10) is not None  # needs 5 pages: 3 free + 2 evicted from the cache
    assert (mgr.allocator.refcount(held // 2) == 1).all()  # the running sequence's pages untouched
    assert mgr.available_pages() == 1  # one cached page left; the running pages never count
    assert mgr.extend(big.kv, 4) is None  # needs 2 pages: refused, nothing changes
    assert big.n_kv == 10 and (mgr.allocator.refcount(held // 2) == 1).all()
    assert mgr.extend(big.kv, 2) is not None  # the last cached page is evicted for it
    assert mgr.radix.n_cached_pages == 0


def test_prefix_sharing_through_the_model_matches_a_cold_run(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "qwen2")
    model = load_model(tmp_path, torch.float32, "cpu")
    cfg = model.config
    model.backend = TorchNativeBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    ps = 4
    config = EngineConfig(page_size=ps, max_running_requests=4)

    def manager() -> tuple[CacheManager, ViewBinder]:
        pool = ReqToTokenPool(4, 64, "cpu")
        storage = KVStorage(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        return CacheManager(config, storage.n_slots, pool), ViewBinder(storage, pool.table)

    def run(rank: tuple[CacheManager, ViewBinder], tokens: list[int]) -> tuple[torch.Tensor, int]:
        mgr, views = rank
        seq = new_seq(tokens)
        assert mgr.alloc(seq.kv, seq.tokens)
        computed = seq.n_tokens - seq.n_kv
        slots = mgr.extend(seq.kv, computed)
        view = views.prefill([seq.row], [seq.n_kv - computed], [computed], slots)
        ids = torch.tensor(tokens[-computed:])
        logits = model(ids, torch.arange(len(tokens) - computed, len(tokens)), view)
        mgr.free(seq.kv, seq.tokens)
        return logits, computed

    shared = list(range(10, 22))  # 3 pages
    first, second = shared + [30, 31, 32], shared + [40, 41, 42, 43, 44]
    warm = manager()
    run(warm, first)
    logits, computed = run(warm, second)
    assert computed == 5, "only the suffix after the 3 shared pages is computed"
    cold_logits, cold_computed = run(manager(), second)
    assert cold_computed == len(second)
    assert (logits - cold_logits[-5:]).abs().max().item() <= 1e-5
