"""The request-to-token table's journal: a replica that applies each journal gets the same table."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.cache.storage import ReqToTokenPool

ROWS, CONTEXT = 3, 12


def apply(replica: torch.Tensor, pool: ReqToTokenPool) -> int:
    rows, positions, slots = pool.take_journal()
    replica[rows, positions] = slots.to(torch.int32)
    return rows.numel()


write = st.tuples(st.integers(0, ROWS - 1), st.integers(0, CONTEXT - 1), st.lists(st.integers(1, 999), max_size=5))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(write, max_size=6), min_size=1, max_size=5))
def test_replica_matches_after_every_step(steps: list[list[tuple[int, int, list[int]]]]) -> None:
    """Runs of writes (some overwriting positions written earlier in the same run), taken step by
    step: the replica equals the table after each, and each position appears once per journal."""
    pool = ReqToTokenPool(ROWS, CONTEXT, "cpu", journal=True)
    replica = torch.zeros_like(pool.table)
    for writes in steps:
        written = set()
        for row, start, slots in writes:
            slots = slots[: CONTEXT - start]
            if len(slots) % 2:
                pool.write(row, start, torch.tensor(slots, dtype=torch.int64))
            else:  # the decode path: scattered single positions
                positions = torch.arange(start, start + len(slots))
                pool.write_positions(torch.full_like(positions, row), positions, torch.tensor(slots, dtype=torch.int64))
            written |= {(row, start + i) for i in range(len(slots))}
        assert apply(replica, pool) == len(written)
        assert torch.equal(replica, pool.table)


def test_no_journal_records_nothing() -> None:
    pool = ReqToTokenPool(ROWS, CONTEXT, "cpu")
    pool.write(0, 0, torch.tensor([4, 5]))
    assert all(t.numel() == 0 for t in pool.take_journal())
    assert pool.table[0, :2].tolist() == [4, 5]
