"""DiskKVTier: a tier of the KV cache (``cache/kv_tier.py``), blocks of keys and values in files of a directory.

A block holds the keys and values of ``block_tokens`` consecutive tokens of a prefix, for every
layer (``kv_tier.block_parts``), and is named by a chain hash of all the tokens up to its end
(``block_keys``), rooted at the tier's namespace: the same prefix under the same model always has
the same names, and nothing else does.

Contracts:

* **One namespace per directory.** The namespace (a hash of the model's config and weights, the
  dtype, KV dtype and block size) is written in ``tier.json``; a directory holding another
  namespace is cleared at start, and ``renamespace`` (a weight update) clears it too, so KV
  computed by other weights is never read.
* **Nothing partial is ever served.** A block is written to a temporary name and renamed when
  whole; every file carries its namespace, name, shape and a CRC32 of its payload, checked on
  each read (``cache/disk_block_file.py``). A corrupt, truncated or foreign file is deleted with a
  log line and reads as a miss. Temporary files a killed process left are deleted at start.
* **A request never waits on a write.** ``save`` queues the block for one background writer
  thread, which only writes files (no torch ops); past ``max_pending_bytes`` of queued blocks, or
  once the disk is full, blocks are dropped (counted), never waited for. A queued block is read
  from memory.
* **Bounded.** Files take at most ``max_bytes``; the least recently used (saved or read) go first.
  The directory is locked (``flock``) while a tier holds it: a second server gets a clear error.
* The index (names in LRU order) is written every ``INDEX_PERIOD_S`` seconds while it changes and
  at ``close``; at start the files present are the truth, the index only orders them
  (``cache/disk_directory.py``).

``contains``, ``load``, ``save``, ``clear`` and ``renamespace`` are called from the engine thread;
the writer thread shares the index under a lock.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import Empty, Queue

import torch

from tokenmill.cache.disk_block_file import (
    READ_ERRORS,
    TMP_SUFFIX,
    block_contents,
    block_path,
    read_payload,
    split_payload,
)
from tokenmill.cache.disk_directory import open_blocks, take_directory, write_index, write_namespace
from tokenmill.cache.kv_tier import block_parts, check_block, part_bytes

logger = logging.getLogger("tokenmill.cache")

INDEX_PERIOD_S = 10.0


@dataclass
class DiskTierStats:
    """Counters for metrics and tests (bytes and seconds are the tier's own file reads and writes)."""

    query_tokens: int = 0  # prompt tokens looked up on disk (past the device's prefix match)
    hit_tokens: int = 0  # of which loaded from disk
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0
    dropped_writes: int = 0  # blocks not written: queue full, disk full or a write error
    rejected_files: int = 0  # corrupt, truncated or foreign files deleted


class DiskKVTier:
    """Blocks of ``block_shape`` (``[n_layers, block_tokens, n_kv_heads, head_dim]``) keys and values
    of ``dtype`` (int8: with their scales) in ``directory``; see the module docstring for the contracts."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        namespace: str,
        block_shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        max_pending_bytes: int = 256 * 1024**2,
    ) -> None:
        """Take ``directory`` (created if missing): raises DiskTierError (``cache/disk_directory.py``)
        if it is not writable, is locked by another tier, or cannot hold ``max_bytes`` (nor one block)."""
        self.directory = Path(directory)
        self.namespace = namespace
        self.block_shape = block_shape
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self.parts = block_parts(block_shape, dtype)
        self.payload_bytes = sum(part_bytes(shape, part_dtype) for shape, part_dtype in self.parts)
        self.stats = DiskTierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> file bytes, least recently used first
        self._bytes = 0
        self._pending: dict[str, tuple[torch.Tensor, ...]] = {}
        self._pending_bytes = 0
        self._queue: Queue[str | None] = Queue()
        self._writing = True
        self._index_dirty = False
        self._generation = 0  # bumped by clear: a write begun before it is discarded
        self._lock_file = take_directory(self.directory, max_bytes, self.payload_bytes, self.block_tokens)
        for name, size in open_blocks(self.directory, namespace):  # least recently used first
            self._index[name] = size
            self._bytes += size
        self._evict_over_budget()
        if self._index:
            logger.info("disk KV tier: %d blocks (%d bytes) from %s", len(self._index), self._bytes, self.directory)
        self._writer = threading.Thread(target=self._write_loop, name="tokenmill-kv-disk-writer", daemon=True)
        self._writer.start()

    @property
    def block_tokens(self) -> int:
        return self.block_shape[1]

    @property
    def n_files(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def n_bytes(self) -> int:
        """Bytes of the tier's files."""
        with self._lock:
            return self._bytes

    def snapshot(self) -> dict[str, float]:
        """Counters (``DiskTierStats``) with the blocks (files) held, their bytes and the byte budget."""
        with self._lock:
            held = {"blocks": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes}
        return {**asdict(self.stats), **held}

    def snapshots(self) -> dict[str, dict[str, float]]:
        return {"disk": self.snapshot()}

    def record_query(self, n_tokens: int) -> None:
        self.stats.query_tokens += n_tokens

    def record_hit(self, key: str, n_tokens: int) -> None:
        self.stats.hit_tokens += n_tokens

    def read_totals(self) -> tuple[int, float]:
        return self.stats.read_bytes, self.stats.read_seconds

    # ------------------------------------------------------------------ engine thread
    def contains(self, key: str) -> bool:
        """Whether block ``key`` is on disk or queued to be written."""
        with self._lock:
            return key in self._index or key in self._pending

    def save(self, key: str, *parts: torch.Tensor) -> bool:
        """Queue block ``key`` (``parts``: keys, values and for int8 their scales, CPU tensors the
        caller no longer writes) for writing; False when it is dropped (already held, too much
        queued, not writing)."""
        check_block(parts, self.parts)
        parts = tuple(part.contiguous() for part in parts)
        with self._lock:
            if key in self._index or key in self._pending:
                return False
            if not self._writing or self._pending_bytes + self.payload_bytes > self.max_pending_bytes:
                self.stats.dropped_writes += 1
                return False
            self._pending[key] = parts
            self._pending_bytes += self.payload_bytes
        self._queue.put(key)
        return True

    def load(self, key: str) -> tuple[torch.Tensor, ...] | None:
        """Block ``key``'s keys and values (and int8 scales), or None when it is not held (or its file failed its
        checks: then the file is deleted and the failure logged)."""
        with self._lock:
            queued = self._pending.get(key)
            if queued is not None:
                return queued
            if key not in self._index:
                return None
            self._index.move_to_end(key)
            self._index_dirty = True
        started = time.perf_counter()
        path = block_path(self.directory, key)
        try:
            with open(path, "rb") as file:
                payload = read_payload(file, self.namespace, key, self.block_shape, self.dtype, self.payload_bytes)
        except FileNotFoundError:  # evicted by the writer since the index said it was there
            self._forget(key)
            return None
        except READ_ERRORS as exc:
            logger.warning("disk KV tier: %s is unusable (%s): deleted", path.name, exc)
            self.stats.rejected_files += 1
            self._forget(key)
            return None
        self.stats.read_seconds += time.perf_counter() - started
        self.stats.read_bytes += len(payload)
        return split_payload(payload, self.parts)

    def clear(self) -> None:
        """Delete every block (on disk and queued)."""
        with self._lock:
            self._generation += 1
            self._pending.clear()
            self._pending_bytes = 0
            self._writing = True  # a full disk may have room now
            names = list(self._index)
            self._index.clear()
            self._bytes = 0
            self._index_dirty = True
        for name in names:
            block_path(self.directory, name).unlink(missing_ok=True)

    def renamespace(self, namespace: str) -> None:
        """Serve ``namespace`` from now on (the weights changed): every block is deleted."""
        self.clear()
        self.namespace = namespace
        write_namespace(self.directory, namespace)

    def close(self) -> None:
        """Write what is queued, then the index, and release the directory."""
        self._queue.put(None)
        self._writer.join()
        self._write_index()
        self._lock_file.close()

    # ------------------------------------------------------------------ index
    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
                self._index_dirty = True
        block_path(self.directory, key).unlink(missing_ok=True)

    def _evict_over_budget(self) -> None:
        """Delete least recently used blocks until the files fit ``max_bytes`` (lock held, or at start)."""
        while self._bytes > self.max_bytes and self._index:
            name, size = self._index.popitem(last=False)
            self._bytes -= size
            self._index_dirty = True
            block_path(self.directory, name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        """Write queued blocks in order until ``close``'s marker; the index when it changed, at most
        every ``INDEX_PERIOD_S`` seconds."""
        last_index = time.monotonic()
        while True:
            try:
                key = self._queue.get(timeout=INDEX_PERIOD_S)
            except Empty:
                key = ""
            if key is None:
                return
            if key:
                self._write_one(key)
            if time.monotonic() - last_index >= INDEX_PERIOD_S:
                self._write_index()
                last_index = time.monotonic()

    def _write_one(self, key: str) -> None:
        """Write queued block ``key`` to a temporary file and rename it into place, unless ``clear``
        came meanwhile (then the write is discarded and ``clear`` already dropped its queue entry)."""
        with self._lock:
            block = self._pending.get(key)
            generation = self._generation
        if block is None:  # cleared while queued, or written under an earlier queue entry
            return
        started = time.perf_counter()
        final = block_path(self.directory, key)
        tmp = final.with_suffix(TMP_SUFFIX)
        try:
            contents = block_contents(self.namespace, key, self.block_shape, self.dtype, block)
            with open(tmp, "wb") as file:
                for chunk in contents:
                    file.write(chunk)
            size = tmp.stat().st_size
        except (OSError, ValueError) as exc:
            tmp.unlink(missing_ok=True)
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            then = ": the disk is full, the tier stops writing" if full else ""
            logger.warning("disk KV tier: writing a block failed (%s)%s", exc, then)
            with self._lock:
                if generation == self._generation:
                    self._unqueue(key)
                    self.stats.dropped_writes += 1
                    self._writing = self._writing and not full
            return
        with self._lock:
            if generation != self._generation:  # cleared while it was written
                tmp.unlink(missing_ok=True)
                return
            self._unqueue(key)
            os.replace(tmp, final)
            self._index[key] = size
            self._bytes += size
            self._index_dirty = True
            self._evict_over_budget()
            self.stats.write_bytes += size
            self.stats.write_seconds += time.perf_counter() - started

    def _unqueue(self, key: str) -> None:
        """Forget queued block ``key`` (lock held)."""
        del self._pending[key]
        self._pending_bytes -= self.payload_bytes

    def _write_index(self) -> None:
        with self._lock:
            if not self._index_dirty:
                return
            names = list(self._index)
            self._index_dirty = False
        write_index(self.directory, names)
