"""ViewBinder: the steady-state decode view advanced in place is exactly the view a rebuild gives."""

from __future__ import annotations

import pytest
import torch

from tests.cache.test_manager import Seq, make_manager, new_seq
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.storage import KVStorage
from tokenmill.cache.view_binder import ViewBinder
from tokenmill.cache.view_builder import make_decode_view
from tokenmill.cache.views import DecodeKVCache


def binder_for(mgr: CacheManager) -> ViewBinder:
    """A binder over storage of the manager's size and the manager's own table (as rank 0's worker)."""
    storage = KVStorage(1, mgr.allocator.capacity * mgr.page_size, 1, 2, torch.float32, "cpu")
    return ViewBinder(storage, mgr.req_pool.table)


def decode_step(mgr: CacheManager, views: ViewBinder, seqs: list[Seq]) -> tuple[DecodeKVCache, torch.Tensor]:
    """One decode step of ``seqs`` (each already one token longer): slots, then the bound view."""
    slots = mgr.extend_decode([s.kv for s in seqs])
    return views.decode([s.row for s in seqs], [s.n_kv for s in seqs], slots), slots


@pytest.mark.parametrize("b_prompt_len", [6, 7])  # B one token longer than A's last step / shorter
def test_recycled_row_gets_the_view_a_rebuild_gives(b_prompt_len: int) -> None:
    """A row recycled to a new sequence: whether the steady-state path advances the previous view
    (B exactly one token longer than A's last decode step: it does) or a rebuild runs, the view is
    what a fresh build from the row, its lengths and its slots gives, pointing at B's slots."""
    mgr = make_manager(1, 64, rows=1)
    views = binder_for(mgr)
    a = new_seq([1] * 4)
    assert mgr.alloc(a.kv, a.tokens)
    mgr.extend(a.kv, a.n_tokens - a.n_kv)
    for _ in range(2):  # A decodes in row 0, reaching the steady state: its last step has length 6
        a.tokens.append(2)
        decode_step(mgr, views, [a])
    assert views.stats.steady_state_steps == 1
    row = a.row
    mgr.free(a.kv, a.tokens, cache_pages=False)

    b = new_seq([0, 2] * 3 + [0] * (b_prompt_len - 6))
    assert mgr.alloc(b.kv, b.tokens) and b.row == row
    mgr.extend(b.kv, b.n_tokens - b.n_kv)
    b.tokens.append(1)
    view, slots = decode_step(mgr, views, [b])
    assert views.stats.steady_state_steps == (2 if b_prompt_len == 6 else 1)
    fresh = make_decode_view(views.storage, mgr.req_pool.table, [row], [b.n_kv], slots)
    for name in ("seq_lens", "out_cache_loc", "req_pool_indices"):
        assert torch.equal(getattr(view, name), getattr(fresh, name)), name
    assert view.max_seq_len == fresh.max_seq_len == b.n_kv == b_prompt_len + 1
    b_slots = mgr.req_pool.table[row, : b.n_kv].tolist()
    assert view.out_cache_loc.tolist() == [b_slots[-1]] == slots.tolist()


def test_steady_state_is_exactly_a_rebuild() -> None:
    """The same decode steps through a binder that advances its view and one rebuilt every step."""
    prompts = [[1, 2, 3], [2, 2, 2, 2, 2]]
    snapshots: dict[str, list[dict]] = {"steady": [], "rebuilt": []}
    fields = ("seq_lens", "out_cache_loc", "req_pool_indices")
    for kind in snapshots:
        mgr = make_manager(2, 32)
        views = binder_for(mgr)
        seqs = [new_seq(p) for p in prompts]
        for s in seqs:
            assert mgr.alloc(s.kv, s.tokens)
            mgr.extend(s.kv, s.n_tokens - s.n_kv)
        for _ in range(4):
            for s in seqs:
                s.tokens.append(1)
            if kind == "rebuilt":
                views = binder_for(mgr)  # a new binder has no previous view: it builds one
            view, _ = decode_step(mgr, views, seqs)
            snapshots[kind].append({f: getattr(view, f).clone() for f in fields} | {"max": view.max_seq_len})
        if kind == "steady":
            assert views.stats.steady_state_steps == 3
    for steady, rebuilt in zip(snapshots["steady"], snapshots["rebuilt"]):
        for f in fields:
            assert torch.equal(steady[f], rebuilt[f]), f
        assert steady["max"] == rebuilt["max"]
