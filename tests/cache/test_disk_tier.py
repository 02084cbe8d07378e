"""Tests for tokenmill.cache.disk_tier: block names, files written in the background and read back
whole or not at all, one namespace per locked directory, an LRU byte budget, and writes dropped
(never waited for) when too much is queued or the disk is full."""

from __future__ import annotations

import builtins
import errno
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill.cache import disk_tier
from tokenmill.cache.disk_block_file import SUFFIX, TMP_SUFFIX
from tokenmill.cache.disk_directory import DiskTierError
from tokenmill.cache.disk_tier import DiskKVTier
from tokenmill.cache.kv_tier import block_keys

# [n_layers, block_tokens, n_kv_heads, head_dim]: 2 KiB of float32 keys and values per block, big
# enough that a budget of a few files passes the tier's floor (one block plus 4096 bytes).
SHAPE = (2, 8, 2, 8)
NS = "namespace-a"
DEADLINE_S = 2.0

Block = tuple[torch.Tensor, torch.Tensor]


def make_block(seed: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE) -> Block:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return k, v


def key(i: int) -> str:
    """A block name of the form ``block_keys`` gives (32 hex digits)."""
    return f"{i:032x}"


def kv_path(tier: DiskKVTier, name: str) -> Path:
    return tier.directory / f"{name}{SUFFIX}"


def kv_files(directory: Path) -> set[str]:
    return {p.stem for p in directory.glob(f"*{SUFFIX}")}


def tmp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{TMP_SUFFIX}"))


def wait_until(condition: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.002)


def wait_written(tier: DiskKVTier, name: str) -> None:
    """Wait until block ``name``'s file is in place (renamed and indexed under the same lock)."""
    wait_until(lambda: kv_path(tier, name).exists())
    assert tier.contains(name)  # takes the lock: the writer's index update is done


def assert_block_equal(got: Block | None, want: Block) -> None:
    assert got is not None
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class Tiers:
    """Opens tiers on one directory and closes every one still open at teardown (releasing the lock)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.opened: list[DiskKVTier] = []
        self.closed: set[int] = set()

    def open(
        self,
        max_bytes: int = 1 << 20,
        namespace: str = NS,
        dtype: torch.dtype = torch.float32,
        directory: Path | None = None,
        **kwargs: Any,
    ) -> DiskKVTier:
        tier = DiskKVTier(directory or self.directory, max_bytes, namespace, SHAPE, dtype, **kwargs)
        self.opened.append(tier)
        return tier

    def close(self, tier: DiskKVTier) -> None:
        if id(tier) not in self.closed:
            self.closed.add(id(tier))
            tier.close()

    def reopen(self, tier: DiskKVTier, **kwargs: Any) -> DiskKVTier:
        self.close(tier)
        return self.open(**{"max_bytes": tier.max_bytes, "namespace": tier.namespace, "dtype": tier.dtype, **kwargs})

    def close_all(self) -> None:
        for tier in reversed(self.opened):
            self.close(tier)


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Tiers]:
    made = Tiers(tmp_path / "tier")
    try:
        yield made
    finally:
        made.close_all()


class Gate:
    """Holds the writer thread in its ``open`` of a temporary file until ``release``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def open(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(TMP_SUFFIX):
            self.entered.set()
            assert self.released.wait(DEADLINE_S * 2)
        return builtins.open(path, *args, **kwargs)

    def wait_entered(self) -> None:
        assert self.entered.wait(DEADLINE_S), "the writer never began the write"
        self.entered.clear()

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    monkeypatch.setattr(disk_tier, "open", held.open, raising=False)
    try:
        yield held
    finally:
        held.release()  # never leave the writer blocked (close joins it)


def written_file_size(tmp_path: Path) -> int:
    """The size on disk of one block's file (its small JSON header plus the payload)."""
    probe = DiskKVTier(tmp_path / "probe", 1 << 20, NS, SHAPE, torch.float32)
    try:
        assert probe.save(key(999), *make_block(999))
        wait_written(probe, key(999))
        return kv_path(probe, key(999)).stat().st_size
    finally:
        probe.close()


# ---------------------------------------------------------------------------------------- block_keys
def test_block_keys_are_deterministic_and_shared_by_a_common_prefix() -> None:
    tokens = list(range(100, 116))
    keys = block_keys("root", tokens, 4, [])
    assert len(keys) == 4 and len(set(keys)) == 4
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    assert block_keys("root", list(tokens), 4, []) == keys
    longer = block_keys("root", tokens + [7, 8, 9, 10, 11, 12, 13, 14], 4, [])
    assert longer[:4] == keys and len(longer) == 6
    diverging = block_keys("root", tokens[:8] + [0] * 8, 4, [])
    assert diverging[:2] == keys[:2] and diverging[2] != keys[2] and diverging[3] != keys[3]


@pytest.mark.parametrize("changed_block", [0, 1, 3])
def test_changing_one_token_changes_the_keys_from_its_block_on(changed_block: int) -> None:
    tokens = list(range(16))
    keys = block_keys("root", tokens, 4, [])
    changed = list(tokens)
    changed[changed_block * 4 + 2] += 1000
    other = block_keys("root", changed, 4, [])
    assert other[:changed_block] == keys[:changed_block]
    assert all(a != b for a, b in zip(other[changed_block:], keys[changed_block:]))


def test_another_root_changes_every_key() -> None:
    tokens = list(range(12))
    keys = block_keys("root", tokens, 4, [])
    other = block_keys("another root", tokens, 4, [])
    assert len(other) == 3 and all(a != b for a, b in zip(keys, other))


def test_block_keys_extends_known_in_place_and_skips_a_partial_block() -> None:
    tokens = list(range(30))
    known: list[str] = []
    result = block_keys("root", tokens[:10], 4, known)  # 2 whole blocks and 2 trailing tokens
    assert result is known and len(known) == 2
    first_two = list(known)
    assert block_keys("root", tokens[:11], 4, known) == first_two  # still no third whole block
    result = block_keys("root", tokens[:13], 4, known)
    assert result is known and len(known) == 3 and known[:2] == first_two
    assert known == block_keys("root", tokens[:12], 4, [])
    # the known names are trusted, not recomputed: the next name chains from them
    seeded = block_keys("root", tokens[:8], 4, ["x" * 32])
    assert seeded[0] == "x" * 32 and seeded[1] != first_two[1]


# ---------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_while_queued_and_after_reopen(tiers: Tiers, gate: Gate, dtype: torch.dtype) -> None:
    tier = tiers.open(dtype=dtype)
    block = make_block(1, dtype)
    assert tier.save(key(1), *block)
    gate.wait_entered()  # the writer holds the block: it is only in memory
    assert tier.contains(key(1))
    assert_block_equal(tier.load(key(1)), block)
    assert tier.stats.read_bytes == 0 and not kv_path(tier, key(1)).exists()
    gate.release()
    tier = tiers.reopen(tier)  # close drains the queue
    assert tier.contains(key(1))
    assert_block_equal(tier.load(key(1)), block)
    assert tier.stats.read_bytes == tier.payload_bytes and tier.read_totals()[1] > 0


def test_load_of_an_unknown_key_is_none(tiers: Tiers) -> None:
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    assert not tier.contains(key(2))
    assert tier.load(key(2)) is None
    wait_written(tier, key(1))
    assert tier.load(key(2)) is None and tier.stats.rejected_files == 0


def test_saving_a_held_key_again_is_refused_without_counting_a_drop(tiers: Tiers) -> None:
    tier = tiers.open()
    first = make_block(1)
    assert tier.save(key(1), *first)
    assert not tier.save(key(1), *make_block(2))  # queued
    wait_written(tier, key(1))
    assert not tier.save(key(1), *make_block(2))  # on disk
    assert tier.stats.dropped_writes == 0
    assert_block_equal(tier.load(key(1)), first)


# ---------------------------------------------------------------------------------------- persistence
def test_reopen_with_the_same_namespace_keeps_the_blocks(tiers: Tiers) -> None:
    tier = tiers.open()
    blocks = {key(i): make_block(i) for i in range(3)}
    for name, block in blocks.items():
        assert tier.save(name, *block)
    tier = tiers.reopen(tier)
    snapshot = tier.snapshot()
    sizes = [kv_path(tier, name).stat().st_size for name in blocks]
    assert snapshot["blocks"] == 3 == tier.n_files
    assert snapshot["bytes"] == sum(sizes) == tier.n_bytes
    assert all(size > tier.payload_bytes for size in sizes)
    for name, block in blocks.items():
        assert tier.contains(name)
        assert_block_equal(tier.load(name), block)


def test_reopen_with_another_namespace_clears_the_directory(tiers: Tiers) -> None:
    tier = tiers.open()
    for i in range(3):
        assert tier.save(key(i), *make_block(i))
    tier = tiers.reopen(tier)
    assert tier.n_files == 3
    tier = tiers.reopen(tier, namespace="namespace-b")
    assert kv_files(tier.directory) == set()
    assert tier.snapshot()["blocks"] == 0 and tier.snapshot()["bytes"] == 0
    assert not tier.contains(key(0)) and tier.load(key(0)) is None
    assert json.loads((tier.directory / "tier.json").read_text())["namespace"] == "namespace-b"
    tier = tiers.reopen(tier, namespace=NS)  # and back: nothing comes back
    assert tier.n_files == 0 and tier.load(key(1)) is None


# ---------------------------------------------------------------------------------------- LRU budget
def budget_of_three(tmp_path: Path) -> int:
    size = written_file_size(tmp_path)
    return 3 * size + size // 2


def test_files_stay_within_the_budget_oldest_first(tiers: Tiers, tmp_path: Path) -> None:
    max_bytes = budget_of_three(tmp_path)
    tier = tiers.open(max_bytes=max_bytes)
    blocks = [make_block(i) for i in range(5)]
    for i, block in enumerate(blocks):
        assert tier.save(key(i), *block)
        wait_written(tier, key(i))
        assert tier.n_bytes <= max_bytes
    assert kv_files(tier.directory) == {key(2), key(3), key(4)}
    assert tier.snapshot()["blocks"] == 3
    for i in (0, 1):
        assert not tier.contains(key(i)) and tier.load(key(i)) is None
    for i in (2, 3, 4):
        assert_block_equal(tier.load(key(i)), blocks[i])


def test_a_load_makes_a_block_the_most_recently_used(tiers: Tiers, tmp_path: Path) -> None:
    tier = tiers.open(max_bytes=budget_of_three(tmp_path))
    for i in range(3):
        assert tier.save(key(i), *make_block(i))
        wait_written(tier, key(i))
    assert_block_equal(tier.load(key(0)), make_block(0))
    assert tier.save(key(3), *make_block(3))
    wait_written(tier, key(3))
    assert kv_files(tier.directory) == {key(0), key(2), key(3)}
    assert tier.save(key(4), *make_block(4))
    wait_written(tier, key(4))
    assert kv_files(tier.directory) == {key(0), key(3), key(4)}


def test_the_lru_order_survives_a_reopen(tiers: Tiers, tmp_path: Path) -> None:
    tier = tiers.open(max_bytes=budget_of_three(tmp_path))
    for i in range(3):
        assert tier.save(key(i), *make_block(i))
        wait_written(tier, key(i))
    assert tier.load(key(0)) is not None  # now 1, 2, 0 (files' ages still say 0, 1, 2)
    tier = tiers.reopen(tier)
    assert json.loads((tier.directory / "index.json").read_text()) == [key(1), key(2), key(0)]
    assert tier.save(key(3), *make_block(3))
    wait_written(tier, key(3))
    assert kv_files(tier.directory) == {key(0), key(2), key(3)}
    assert_block_equal(tier.load(key(0)), make_block(0))


# ---------------------------------------------------------------------------------------- bad files
def flip_last_payload_byte(path: Path, tier: DiskKVTier) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_payload(path: Path, tier: DiskKVTier) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def cut_in_the_header(path: Path, tier: DiskKVTier) -> None:
    path.write_bytes(path.read_bytes()[:10])


def garbage(path: Path, tier: DiskKVTier) -> None:
    path.write_bytes(bytes(range(256)) * 9)


def another_keys_file(path: Path, tier: DiskKVTier) -> None:
    shutil.copyfile(kv_path(tier, key(2)), path)


def foreign_namespace(path: Path, tier: DiskKVTier) -> None:
    other = DiskKVTier(tier.directory.parent / "other", 1 << 20, "namespace-b", SHAPE, torch.float32)
    try:
        assert other.save(key(1), *make_block(1))  # same name, same data, another namespace
    finally:
        other.close()
    shutil.copyfile(other.directory / path.name, path)


def deeply_nested_header(path: Path, tier: DiskKVTier) -> None:
    """A header of 4,000 nested arrays: the JSON parser's recursion limit, as a miss (not an engine fault)."""
    data = path.read_bytes()
    header = b"[" * 4000
    path.write_bytes(data[:8] + len(header).to_bytes(4, "little") + header)


@pytest.mark.parametrize(
    "damage",
    [
        flip_last_payload_byte,
        truncate_payload,
        cut_in_the_header,
        garbage,
        another_keys_file,
        foreign_namespace,
        deeply_nested_header,
    ],
)
def test_a_bad_file_reads_as_a_miss_and_is_deleted(tiers: Tiers, damage: Callable[[Path, DiskKVTier], None]) -> None:
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    assert tier.save(key(2), *make_block(2))
    tier = tiers.reopen(tier)
    damage(kv_path(tier, key(1)), tier)
    tier = tiers.reopen(tier)
    assert tier.contains(key(1))  # the files present are the truth until read
    assert tier.load(key(1)) is None
    assert not kv_path(tier, key(1)).exists() and not tier.contains(key(1))
    assert tier.stats.rejected_files == 1 and tier.n_files == 1
    assert tier.n_bytes == kv_path(tier, key(2)).stat().st_size
    assert_block_equal(tier.load(key(2)), make_block(2))
    assert tier.save(key(1), *make_block(1))  # the tier keeps working for that name
    wait_written(tier, key(1))
    assert_block_equal(tier.load(key(1)), make_block(1))
    assert tier.stats.rejected_files == 1


def test_a_file_damaged_while_open_is_rejected(tiers: Tiers) -> None:
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    wait_written(tier, key(1))
    flip_last_payload_byte(kv_path(tier, key(1)), tier)
    assert tier.load(key(1)) is None
    assert tier.stats.rejected_files == 1 and not kv_path(tier, key(1)).exists() and tier.n_bytes == 0


def test_leftover_temporary_files_are_deleted_at_start_and_never_served(tiers: Tiers) -> None:
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    tier = tiers.reopen(tier)
    directory = tier.directory
    tiers.close(tier)
    shutil.copyfile(directory / f"{key(1)}{SUFFIX}", directory / f"{key(2)}{TMP_SUFFIX}")  # a whole block, unrenamed
    (directory / f"{key(3)}{TMP_SUFFIX}").write_bytes(b"TMKV0001 partial")
    (directory / f"index.json{TMP_SUFFIX}").write_text("[")
    tier = tiers.open()
    assert tmp_files(directory) == []
    assert not tier.contains(key(2)) and tier.load(key(2)) is None
    assert not tier.contains(key(3)) and tier.load(key(3)) is None
    assert tier.n_files == 1 and tier.stats.rejected_files == 0
    assert_block_equal(tier.load(key(1)), make_block(1))


# ---------------------------------------------------------------------------------------- start errors
@pytest.mark.parametrize("name", ["tier.json", "index.json"])
def test_nested_or_foreign_metadata_reads_as_absent(tiers: Tiers, name: str) -> None:
    """A tier.json or index.json the tier did not write (nested past the parser's depth, not an object /
    a list) starts the tier all the same: tier.json as none (the blocks are cleared), index.json as
    no order (the blocks stay)."""
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    tier = tiers.reopen(tier)
    for content in ("[" * 100_000, "7", '{"namespace": [1]}' if name == "tier.json" else '{"a": 1}'):
        tiers.close(tier)
        (tiers.directory / name).write_text(content)
        tier = tiers.open()
        if name == "index.json":
            assert_block_equal(tier.load(key(1)), make_block(1))
        else:
            assert tier.n_files == 0 and tier.save(key(1), *make_block(1))
            wait_written(tier, key(1))


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tiers: Tiers, tmp_path: Path) -> None:
    """Pointed at a folder that holds files but is no tier's (no tier.json naming a namespace), the tier
    refuses to start and deletes, writes or locks nothing there (it would delete files it did not write)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    mine = {"notes.txt": "keep", "draft.tmp": "keep", "x.kv": "keep", "index.json": "[]", "tier.json": "{}"}
    for name, text in mine.items():
        (folder / name).write_text(text)
    with pytest.raises(DiskTierError, match="no tier.json naming a KV tier"):
        tiers.open(directory=folder)
    assert {p.name: p.read_text() for p in folder.iterdir()} == mine
    empty = tmp_path / "empty"
    empty.mkdir()
    tier = tiers.open(directory=empty)  # an empty folder (or a new one) is fine
    assert tier.save(key(1), *make_block(1))


def test_a_regular_file_as_directory_is_refused(tiers: Tiers, tmp_path: Path) -> None:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    with pytest.raises(DiskTierError, match=re.escape(str(path))):
        tiers.open(directory=path)
    assert path.read_text() == "not a directory"


def test_a_directory_held_by_another_tier_is_refused_until_released(tiers: Tiers) -> None:
    first = tiers.open()
    with pytest.raises(DiskTierError, match="in use") as raised:
        tiers.open()
    assert str(tiers.directory) in str(raised.value)
    assert first.save(key(1), *make_block(1))  # the first tier is unaffected
    tiers.close(first)
    second = tiers.open()
    assert_block_equal(second.load(key(1)), make_block(1))


def test_a_budget_below_one_block_is_refused_and_the_lock_released(tiers: Tiers) -> None:
    payload = 2 * torch.Size(SHAPE).numel() * 4
    with pytest.raises(DiskTierError, match="one block"):
        tiers.open(max_bytes=payload)
    tier = tiers.open(max_bytes=payload + 4096)  # the smallest budget accepted
    assert tier.payload_bytes == payload


def test_a_budget_below_one_block_names_the_directory(tiers: Tiers) -> None:
    with pytest.raises(DiskTierError) as raised:
        tiers.open(max_bytes=1024)
    assert str(tiers.directory) in str(raised.value)


def test_a_budget_beyond_the_free_space_is_refused_and_the_lock_released(tiers: Tiers) -> None:
    with pytest.raises(DiskTierError, match="free space") as raised:
        tiers.open(max_bytes=1 << 60)
    assert str(tiers.directory) in str(raised.value)
    tiers.open()


# ---------------------------------------------------------------------------------------- dropped writes
def test_a_pending_budget_below_one_block_drops_every_save(tiers: Tiers) -> None:
    tier = tiers.open(max_pending_bytes=2 * torch.Size(SHAPE).numel() * 4 - 1)
    assert not tier.save(key(1), *make_block(1))
    assert not tier.save(key(2), *make_block(2))
    assert tier.stats.dropped_writes == 2
    assert not tier.contains(key(1)) and tier.load(key(1)) is None
    tier = tiers.reopen(tier)
    assert kv_files(tier.directory) == set() and tier.n_files == 0 and tier.stats.write_bytes == 0


def test_saves_past_the_pending_budget_are_dropped_not_waited_for(tiers: Tiers, gate: Gate) -> None:
    tier = tiers.open(max_pending_bytes=2 * torch.Size(SHAPE).numel() * 4)  # one block
    assert tier.save(key(1), *make_block(1))
    gate.wait_entered()
    started = time.monotonic()
    assert not tier.save(key(2), *make_block(2))
    assert time.monotonic() - started < 0.5
    assert tier.stats.dropped_writes == 1 and not tier.contains(key(2))
    gate.release()
    wait_written(tier, key(1))
    assert tier.save(key(3), *make_block(3))  # room again once written
    wait_written(tier, key(3))
    assert kv_files(tier.directory) == {key(1), key(3)}


def test_a_full_disk_stops_the_writes_and_keeps_the_reads(tiers: Tiers, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    wait_written(tier, key(1))
    attempts: list[str] = []

    def full_disk_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(TMP_SUFFIX):
            attempts.append(str(path))
            with builtins.open(path, "wb") as partial:  # leave a partial file, as a real ENOSPC may
                partial.write(b"TMKV0001")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(disk_tier, "open", full_disk_open, raising=False)
    assert tier.save(key(2), *make_block(2))  # queued: the write fails in the background
    wait_until(lambda: tier.stats.dropped_writes == 1)
    assert not tier.contains(key(2)) and tier.load(key(2)) is None
    assert not tier.save(key(3), *make_block(3))  # the tier stopped writing
    assert tier.stats.dropped_writes == 2 and len(attempts) == 1
    assert tmp_files(tier.directory) == []
    assert_block_equal(tier.load(key(1)), make_block(1))
    assert kv_files(tier.directory) == {key(1)}


# ---------------------------------------------------------------------------------------- clear, renamespace
def test_clear_deletes_files_and_queued_blocks(tiers: Tiers, gate: Gate) -> None:
    tier = tiers.open()
    gate.release()
    assert tier.save(key(1), *make_block(1))
    wait_written(tier, key(1))
    gate.released.clear()
    assert tier.save(key(2), *make_block(2))
    gate.wait_entered()  # key 2 is being written
    assert tier.save(key(3), *make_block(3))  # key 3 is queued behind it
    tier.clear()
    for i in (1, 2, 3):
        assert not tier.contains(key(i)) and tier.load(key(i)) is None
    assert kv_files(tier.directory) == set() and tier.n_files == 0 and tier.n_bytes == 0
    gate.release()
    tier = tiers.reopen(tier)
    assert kv_files(tier.directory) == set() and tmp_files(tier.directory) == []
    assert tier.n_files == 0
    assert tier.save(key(1), *make_block(1))  # and it works after
    wait_written(tier, key(1))
    assert_block_equal(tier.load(key(1)), make_block(1))


def test_renamespace_clears_and_a_reopen_keeps_the_later_blocks(tiers: Tiers) -> None:
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    wait_written(tier, key(1))
    tier.renamespace("namespace-b")
    assert tier.namespace == "namespace-b"
    assert not tier.contains(key(1)) and not kv_path(tier, key(1)).exists()
    assert tier.save(key(2), *make_block(2))
    tier = tiers.reopen(tier, namespace="namespace-b")
    assert kv_files(tier.directory) == {key(2)}
    assert tier.load(key(1)) is None
    assert_block_equal(tier.load(key(2)), make_block(2))
    tier = tiers.reopen(tier, namespace=NS)  # the old weights again: the new blocks are not theirs
    assert tier.n_files == 0 and tier.load(key(2)) is None


# ---------------------------------------------------------------------------------------- bad blocks
@pytest.mark.parametrize(
    "k_shape, k_dtype, v_shape",
    [
        ((2, 4, 2, 8), torch.float32, SHAPE),
        (SHAPE, torch.float32, (2, 8, 2, 4)),
        (SHAPE, torch.float16, SHAPE),
    ],
    ids=["k-shape", "v-shape", "k-dtype"],
)
def test_a_block_of_another_shape_or_dtype_is_refused(
    tiers: Tiers, k_shape: tuple[int, ...], k_dtype: torch.dtype, v_shape: tuple[int, ...]
) -> None:
    tier = tiers.open()
    k = torch.zeros(k_shape, dtype=k_dtype)
    v = torch.zeros(v_shape)
    with pytest.raises(ValueError):
        tier.save(key(1), k, v)
    assert not tier.contains(key(1)) and tier.stats.dropped_writes == 0


def test_a_value_tensor_of_another_dtype_is_refused(tiers: Tiers) -> None:
    tier = tiers.open()
    k, v = make_block(1)
    with pytest.raises(ValueError):
        tier.save(key(1), k, v.double())


def test_a_non_contiguous_block_does_not_stop_the_writer(tiers: Tiers) -> None:
    tier = tiers.open()
    k, v = make_block(1, shape=(SHAPE[1], SHAPE[0], *SHAPE[2:]))
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # block_shape, but not contiguous
    try:
        tier.save(key(1), k, v)
    except ValueError:
        pass  # refusing it is fine too
    assert tier.save(key(2), *make_block(2))
    wait_until(lambda: kv_path(tier, key(2)).exists(), timeout=0.5)


def test_clear_during_a_write_keeps_the_pending_budget(tiers: Tiers, gate: Gate) -> None:
    tier = tiers.open(max_pending_bytes=2 * torch.Size(SHAPE).numel() * 4)  # one block
    assert tier.save(key(1), *make_block(1))
    gate.wait_entered()
    tier.clear()
    gate.release()
    assert tier.save(key(2), *make_block(2))
    wait_written(tier, key(2))  # one writer, in order: the interrupted write is over too
    assert kv_files(tier.directory) == {key(2)}
    gate.released.clear()
    assert tier.save(key(3), *make_block(3))
    gate.wait_entered()
    assert not tier.save(key(4), *make_block(4))  # one block is queued: the budget is full


def test_a_block_saved_again_after_clear_during_its_write_is_kept(tiers: Tiers, gate: Gate) -> None:
    tier = tiers.open()
    assert tier.save(key(1), *make_block(1))
    gate.wait_entered()
    tier.clear()
    assert tier.save(key(1), *make_block(11))
    gate.release()
    tier = tiers.reopen(tier)  # close drains the queue: the block queued last is on disk
    assert_block_equal(tier.load(key(1)), make_block(11))


def test_an_int8_block_carries_its_scales_through_a_reopen(tiers: Tiers) -> None:
    """int8 blocks have four parts (keys, values, their fp32 scales [n_layers, block_tokens,
    n_kv_heads]); a block without its scales is refused."""
    tier = tiers.open(dtype=torch.int8)
    k, v = (torch.randint(-127, 128, SHAPE, dtype=torch.int8) for _ in range(2))
    k_scale, v_scale = torch.rand(SHAPE[:3]), torch.rand(SHAPE[:3])
    with pytest.raises(ValueError, match="4 parts"):
        tier.save(key(1), k, v)
    assert tier.save(key(1), k, v, k_scale, v_scale)
    tier = tiers.reopen(tier)
    loaded = tier.load(key(1))
    assert loaded is not None and len(loaded) == 4
    assert all(torch.equal(a, b) for a, b in zip(loaded, (k, v, k_scale, v_scale)))


@pytest.mark.parametrize(("fp8", "other"), [(torch.float8_e4m3fn, torch.float8_e5m2), (torch.float8_e5m2, torch.int8)])
def test_an_fp8_block_round_trips_and_no_other_kv_dtype_reads_it(
    tiers: Tiers, fp8: torch.dtype, other: torch.dtype
) -> None:
    """fp8 blocks are their keys' and values' bytes alone (every byte pattern, NaNs included), equal
    after a reopen; each file carries the KV dtype, so a tier of another one (even of the same size)
    on the same directory and namespace never serves it."""
    tier = tiers.open(dtype=fp8)
    k, v = (torch.randint(0, 256, SHAPE, dtype=torch.uint8).view(fp8) for _ in range(2))
    assert tier.payload_bytes == 2 * k.numel()
    assert tier.save(key(1), k, v)
    tier = tiers.reopen(tier)
    loaded = tier.load(key(1))
    assert loaded is not None and len(loaded) == 2 and all(part.dtype == fp8 for part in loaded)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(loaded, (k, v)))
    assert tiers.reopen(tier, dtype=other).load(key(1)) is None
