"""DiskKVTier: the KV cache's second tier, blocks of keys and values in files of a directory.

A block holds the keys and values of ``block_tokens`` consecutive tokens of a prefix, for every
layer (``[n_layers, block_tokens, n_kv_heads, head_dim]`` each; an int8 block also their fp32
scales, ``[n_layers, block_tokens, n_kv_heads]`` each, see ``cache/kv_quant.py``; an fp8 block its bytes
alone, ``cache/kv_fp8.py``), and is named by a chain hash of
all the tokens up to its end (``block_keys``), rooted at the tier's namespace: the same prefix
under the same model always has the same names, and nothing else does.

Contracts:

* **One namespace per directory.** The namespace (a hash of the model's config and weights, the
  dtype, KV dtype and block size) is written in ``tier.json``; a directory holding another
  namespace is cleared at start, and ``renamespace`` (a weight update) clears it too, so KV
  computed by other weights is never read.
* **Nothing partial is ever served.** A block is written to a temporary name and renamed when
  whole; every file carries its namespace, name, shape and a CRC32 of its payload, checked on
  each read. A corrupt, truncated or foreign file is deleted with a log line and reads as a miss.
  Temporary files a killed process left are deleted at start.
* **A request never waits on a write.** ``save`` queues the block for one background writer
  thread, which only writes files (no torch ops); past ``max_pending_bytes`` of queued blocks, or
  once the disk is full, blocks are dropped (counted), never waited for. A queued block is read
  from memory.
* **Bounded.** Files take at most ``max_bytes``; the least recently used (saved or read) go first.
  The directory is locked (``flock``) while a tier holds it: a second server gets a clear error.
* The index (names in LRU order) is written every ``INDEX_PERIOD_S`` seconds while it changes and
  at ``close``; at start the files present are the truth, the index only orders them.

``contains``, ``load``, ``save``, ``clear`` and ``renamespace`` are called from the engine thread;
the writer thread shares the index under a lock.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import Empty, Queue
from typing import IO

import torch

from tokenmill.cache.storage import KVStorage
from tokenmill.config import EngineConfig

logger = logging.getLogger("tokenmill.cache")

FORMAT = b"TMKV0001"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
INDEX_PERIOD_S = 10.0
BLOCK_TOKENS = 64
_HEADER_LEN = struct.Struct("<I")


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


class DiskTierError(ValueError):
    """A disk tier that cannot start: the message names the directory and what is wrong."""


def block_keys(root: str, tokens: Sequence[int], block_tokens: int, known: list[str]) -> list[str]:
    """The names of the whole blocks of ``tokens``: ``known`` (a list of those computed before, for
    the same tokens and root) extended in place and returned."""
    for b in range(len(known), len(tokens) // block_tokens):
        previous = known[b - 1] if b else root
        block = struct.pack(f"<{block_tokens}q", *tokens[b * block_tokens : (b + 1) * block_tokens])
        known.append(hashlib.blake2b(previous.encode() + block, digest_size=16).hexdigest())
    return known


def open_disk_tier(config: EngineConfig, storage: KVStorage, namespace: str) -> DiskKVTier:
    """The tier ``config`` asks for (``kv_cache_disk_dir``, ``kv_cache_disk_bytes``) for blocks of
    ``storage``'s layers, heads and dtype; blocks of ``max(BLOCK_TOKENS, page_size)`` tokens."""
    assert config.kv_cache_disk_dir is not None
    n_layers, _, n_kv_heads, head_dim = storage.k_buffer.shape
    block = (n_layers, max(BLOCK_TOKENS, config.page_size), n_kv_heads, head_dim)
    return DiskKVTier(config.kv_cache_disk_dir, config.kv_cache_disk_bytes, namespace, block, storage.k_buffer.dtype)


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
        """Take ``directory`` (created if missing): raises DiskTierError if it is not writable, is
        locked by another tier, or cannot hold ``max_bytes`` (nor one block)."""
        self.directory = Path(directory)
        self.namespace = namespace
        self.block_shape = block_shape
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        scales = [(block_shape[:3], torch.float32)] * 2 if dtype == torch.int8 else []
        self.parts: list[tuple[tuple[int, ...], torch.dtype]] = [(block_shape, dtype)] * 2 + scales
        self.payload_bytes = sum(_part_bytes(shape, part_dtype) for shape, part_dtype in self.parts)
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
        self._lock_file = self._take_directory(max_bytes)
        self._open_namespace()
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
        """Counters (``DiskTierStats``) with the files' count and bytes and the byte budget."""
        with self._lock:
            held = {"files": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes}
        return {**asdict(self.stats), **held}

    def read_bytes_per_second(self) -> float | None:
        """Measured read speed (None before the first read)."""
        stats = self.stats
        return stats.read_bytes / stats.read_seconds if stats.read_seconds > 0 else None

    # ------------------------------------------------------------------ engine thread
    def contains(self, key: str) -> bool:
        """Whether block ``key`` is on disk or queued to be written."""
        with self._lock:
            return key in self._index or key in self._pending

    def save(self, key: str, *parts: torch.Tensor) -> bool:
        """Queue block ``key`` (``parts``: keys, values and for int8 their scales, CPU tensors the
        caller no longer writes) for writing; False when it is dropped (already held, too much
        queued, not writing)."""
        if len(parts) != len(self.parts):
            raise ValueError(f"a block has {len(self.parts)} parts (keys, values, int8 scales), got {len(parts)}")
        for part, (shape, dtype) in zip(parts, self.parts):
            if part.shape != shape or part.dtype != dtype:
                raise ValueError(f"a block part is {shape} {dtype}, got {tuple(part.shape)} {part.dtype}")
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
        path = self._path(key)
        try:
            with open(path, "rb") as file:
                payload = self._read_checked(file, key)
        except FileNotFoundError:  # evicted by the writer since the index said it was there
            self._forget(key)
            return None
        except (OSError, ValueError, AttributeError, struct.error) as exc:
            logger.warning("disk KV tier: %s is unusable (%s): deleted", path.name, exc)
            self.stats.rejected_files += 1
            self._forget(key)
            return None
        self.stats.read_seconds += time.perf_counter() - started
        self.stats.read_bytes += len(payload)
        flat, parts, start = torch.frombuffer(payload, dtype=torch.uint8), [], 0
        for shape, dtype in self.parts:
            n = _part_bytes(shape, dtype)
            parts.append(flat[start : start + n].view(dtype).view(shape))
            start += n
        return tuple(parts)

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
            self._path(name).unlink(missing_ok=True)

    def renamespace(self, namespace: str) -> None:
        """Serve ``namespace`` from now on (the weights changed): every block is deleted."""
        self.clear()
        self.namespace = namespace
        self._write_meta()

    def close(self) -> None:
        """Write what is queued, then the index, and release the directory."""
        self._queue.put(None)
        self._writer.join()
        self._write_index()
        self._lock_file.close()

    # ------------------------------------------------------------------ start
    def _take_directory(self, max_bytes: int) -> IO[bytes]:
        where = self.directory
        try:
            where.mkdir(parents=True, exist_ok=True)
            lock_file = open(where / ".lock", "ab")  # noqa: SIM115 (held for the tier's life)
        except OSError as exc:
            raise DiskTierError(f"KV disk directory {where} is not usable: {exc}") from None
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.close()
            raise DiskTierError(f"KV disk directory {where} is in use by another tokenmill process") from None
        if not os.access(where, os.W_OK | os.X_OK):
            lock_file.close()
            raise DiskTierError(f"KV disk directory {where} is not writable")
        if max_bytes < self.payload_bytes + 4096:
            lock_file.close()
            raise DiskTierError(
                f"KV disk directory {where}: kv_cache_disk_bytes {max_bytes} cannot hold one block of "
                f"{self.block_tokens} tokens ({self.payload_bytes} bytes)"
            )
        held = sum(p.stat().st_size for p in where.glob(f"*{SUFFIX}"))
        free = shutil.disk_usage(where).free
        if free + held < max_bytes:
            lock_file.close()
            raise DiskTierError(
                f"KV disk directory {where} has {free + held} bytes for the tier, kv_cache_disk_bytes asks for "
                f"{max_bytes}: lower it or free space"
            )
        return lock_file

    def _open_namespace(self) -> None:
        meta = self.directory / "tier.json"
        try:
            held = json.loads(meta.read_text()).get("namespace")
        except (OSError, ValueError, AttributeError):
            held = None
        for tmp in self.directory.glob(f"*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        files = {p.stem: p.stat().st_size for p in self.directory.glob(f"*{SUFFIX}")}
        if held != self.namespace:
            if files:
                logger.info("disk KV tier: %s held another model's KV (%d blocks): cleared", self.directory, len(files))
            for name in files:
                self._path(name).unlink(missing_ok=True)
            (self.directory / "index.json").unlink(missing_ok=True)
            self._write_meta()
            return
        try:
            order = json.loads((self.directory / "index.json").read_text())
        except (OSError, ValueError):
            order = []
        listed = [name for name in order if isinstance(name, str) and name in files]
        unlisted = sorted(set(files) - set(listed), key=lambda name: self._path(name).stat().st_mtime_ns)
        for name in listed + unlisted:  # unlisted ones were written after the last index: the newest
            self._index[name] = files[name]
            self._bytes += files[name]
        self._evict_over_budget()
        if self._index:
            logger.info("disk KV tier: %d blocks (%d bytes) from %s", len(self._index), self._bytes, self.directory)

    def _write_meta(self) -> None:
        _replace_with(self.directory / "tier.json", json.dumps({"namespace": self.namespace}).encode())

    # ------------------------------------------------------------------ files
    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _header(self, key: str, crc: int) -> bytes:
        fields = {"namespace": self.namespace, "key": key, "shape": list(self.block_shape), "dtype": str(self.dtype)}
        text = json.dumps({**fields, "crc32": crc}).encode()
        return FORMAT + _HEADER_LEN.pack(len(text)) + text

    def _read_checked(self, file: IO[bytes], key: str) -> bytearray:
        if file.read(len(FORMAT)) != FORMAT:
            raise ValueError("not a tokenmill KV block")
        (n,) = _HEADER_LEN.unpack(file.read(_HEADER_LEN.size))
        if n > 4096:
            raise ValueError("header too long")
        header = json.loads(file.read(n))
        expected = {"namespace": self.namespace, "key": key, "shape": list(self.block_shape), "dtype": str(self.dtype)}
        if any(header.get(name) != value for name, value in expected.items()):
            raise ValueError("written for another model, block or shape")
        payload = bytearray(self.payload_bytes)
        if file.readinto(payload) != self.payload_bytes or file.read(1):
            raise ValueError("truncated or too long")
        if zlib.crc32(payload) != header.get("crc32"):
            raise ValueError("checksum mismatch")
        return payload

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
                self._index_dirty = True
        self._path(key).unlink(missing_ok=True)

    def _evict_over_budget(self) -> None:
        """Delete least recently used blocks until the files fit ``max_bytes`` (lock held, or at start)."""
        while self._bytes > self.max_bytes and self._index:
            name, size = self._index.popitem(last=False)
            self._bytes -= size
            self._index_dirty = True
            self._path(name).unlink(missing_ok=True)

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
        final, tmp = self._path(key), self._path(key).with_suffix(TMP_SUFFIX)
        try:
            payloads = [part.view(torch.uint8).numpy() for part in block]
            crc = 0
            for payload in payloads:
                crc = zlib.crc32(payload, crc)
            with open(tmp, "wb") as file:
                file.write(self._header(key, crc))
                for payload in payloads:
                    file.write(payload)
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
        try:
            _replace_with(self.directory / "index.json", json.dumps(names).encode())
        except OSError as exc:
            logger.warning("disk KV tier: writing its index failed: %s", exc)


def _part_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _replace_with(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_bytes(data)
    os.replace(tmp, path)
