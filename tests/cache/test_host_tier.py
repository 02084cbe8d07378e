"""Tests for tokenmill.cache.host_tier: blocks kept in memory under an LRU byte budget, and chained
in front of the disk tier (write-through, blocks loaded from disk kept in memory, each tier's hits
counted where they were served, clear and renamespace reaching both)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenmill.cache.disk_block_file import SUFFIX
from tokenmill.cache.disk_tier import DiskKVTier
from tokenmill.cache.host_tier import HostKVTier
from tokenmill.cache.kv_tier import block_parts, part_bytes

SHAPE = (2, 8, 2, 8)  # [n_layers, block_tokens, n_kv_heads, head_dim]
NS = "namespace-a"
BLOCK_BYTES = sum(part_bytes(shape, dtype) for shape, dtype in block_parts(SHAPE, torch.float32))


def make_block(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=generator).to(dtype) for shape, _ in block_parts(SHAPE, dtype))


def key(i: int) -> str:
    return f"{i:032x}"


def equal(a: tuple[torch.Tensor, ...] | None, b: tuple[torch.Tensor, ...]) -> bool:
    return a is not None and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskKVTier]:
    tier = DiskKVTier(tmp_path, 64 * BLOCK_BYTES, NS, SHAPE, torch.float32)
    yield tier
    tier.close()


def on_disk(tier: DiskKVTier, name: str) -> bool:
    """Whether block ``name``'s file is written (waits up to two seconds for the writer thread)."""
    deadline = time.monotonic() + 2.0
    while not (tier.directory / f"{name}{SUFFIX}").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    return (tier.directory / f"{name}{SUFFIX}").exists()


def test_blocks_come_back_equal_and_the_least_recently_used_go_past_the_budget() -> None:
    tier = HostKVTier(3 * BLOCK_BYTES, NS, SHAPE, torch.float32)
    blocks = {i: make_block(i) for i in range(5)}
    for i in range(3):
        assert tier.save(key(i), *blocks[i])
    assert not tier.save(key(0), *blocks[0])  # held already: nothing added, 0 the most recently used
    assert equal(tier.load(key(1)), blocks[1])  # now 1; 2 the least recently used
    assert tier.save(key(3), *blocks[3])  # over budget: 2 goes
    assert tier.n_bytes == 3 * BLOCK_BYTES <= tier.max_bytes
    assert [tier.contains(key(i)) for i in range(4)] == [True, True, False, True]
    assert tier.load(key(2)) is None and tier.stats.evicted_blocks == 1
    assert tier.save(key(4), *blocks[4])
    assert [tier.contains(key(i)) for i in range(5)] == [False, True, False, True, True]
    for i in (1, 3, 4):
        assert equal(tier.load(key(i)), blocks[i])
    assert tier.stats.read_bytes == 4 * BLOCK_BYTES and tier.read_totals()[0] == 4 * BLOCK_BYTES
    snapshot = tier.snapshot()
    assert (snapshot["blocks"], snapshot["bytes"], snapshot["max_bytes"]) == (3, 3 * BLOCK_BYTES, 3 * BLOCK_BYTES)


def test_int8_blocks_keep_their_scales() -> None:
    tier = HostKVTier(2 * BLOCK_BYTES, NS, SHAPE, torch.int8)
    block = (
        torch.randint(-127, 128, SHAPE, dtype=torch.int8),
        torch.randint(-127, 128, SHAPE, dtype=torch.int8),
        torch.rand(SHAPE[:3]),
        torch.rand(SHAPE[:3]),
    )
    tier.save(key(1), *block)
    assert equal(tier.load(key(1)), block)


def test_bad_blocks_and_budgets_are_refused(disk: DiskKVTier) -> None:
    with pytest.raises(ValueError, match="cannot hold one block"):
        HostKVTier(BLOCK_BYTES - 1, NS, SHAPE, torch.float32)
    with pytest.raises(ValueError, match="same blocks"):
        HostKVTier(4 * BLOCK_BYTES, "another namespace", SHAPE, torch.float32, lower=disk)
    tier = HostKVTier(4 * BLOCK_BYTES, NS, SHAPE, torch.float32)
    k, v = make_block(0)
    with pytest.raises(ValueError, match="part"):
        tier.save(key(0), k, v[:, :4])
    with pytest.raises(ValueError, match="parts"):
        tier.save(key(0), k)
    assert not tier.contains(key(0)) and tier.n_blocks == 0


def test_in_front_of_disk_writes_through_and_keeps_what_it_loads(disk: DiskKVTier) -> None:
    tier = HostKVTier(2 * BLOCK_BYTES, NS, SHAPE, torch.float32, lower=disk)
    blocks = {i: make_block(i) for i in range(3)}
    for i in range(3):
        tier.save(key(i), *blocks[i])
    assert all(on_disk(disk, key(i)) for i in range(3))  # every block reached the disk
    assert not tier.holds(key(0)) and tier.contains(key(0))  # dropped from memory, still on disk
    tier.record_query(3 * SHAPE[1])
    assert equal(tier.load(key(0)), blocks[0]) and disk.stats.read_bytes > 0
    assert tier.holds(key(0)) and not tier.holds(key(1))  # kept in memory; 1 was the least recent
    assert equal(tier.load(key(2)), blocks[2])
    tier.record_hit(key(0), 5)  # served by the disk
    tier.record_hit(key(2), SHAPE[1])  # served from memory
    host, lower = tier.snapshots()["host"], tier.snapshots()["disk"]
    assert (host["hit_tokens"], lower["hit_tokens"]) == (SHAPE[1], 5)
    assert host["query_tokens"] == lower["query_tokens"] == 3 * SHAPE[1]
    read_bytes, seconds = tier.read_totals()
    assert read_bytes == host["read_bytes"] + lower["read_bytes"] and seconds > 0
    tier.record_query(SHAPE[1])
    assert equal(tier.load(key(0)), blocks[0])
    tier.record_hit(key(0), SHAPE[1])  # now from memory
    assert tier.snapshots()["host"]["hit_tokens"] == 2 * SHAPE[1] and disk.stats.hit_tokens == 5


def test_clear_and_renamespace_reach_the_disk(disk: DiskKVTier) -> None:
    tier = HostKVTier(4 * BLOCK_BYTES, NS, SHAPE, torch.float32, lower=disk)
    tier.save(key(1), *make_block(1))
    assert on_disk(disk, key(1))
    tier.clear()
    assert not tier.contains(key(1)) and disk.n_files == 0
    tier.save(key(2), *make_block(2))
    assert on_disk(disk, key(2))
    tier.renamespace("namespace-b")
    assert tier.namespace == disk.namespace == "namespace-b"
    assert not tier.contains(key(2)) and disk.n_files == 0 and tier.n_blocks == 0
