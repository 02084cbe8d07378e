"""The disk tier's directory (``cache/disk_tier.py``) besides its block files (``cache/disk_block_file.py``):
``.lock`` is locked (``flock``) while a tier holds the directory, ``tier.json`` names the namespace
its blocks belong to, ``index.json`` lists their names least recently used first.

:func:`take_directory` takes it for one tier, or raises :class:`DiskTierError`. At start
(:func:`open_blocks`) the block files present are the truth and the index only orders them;
temporary files a killed process left are deleted, and a directory of another namespace loses
every block. ``tier.json`` and ``index.json`` are written whole or not at all, and read as absent when they are
not what the tier writes. A directory that holds other files and no ``tier.json`` is refused: the
tier never deletes files it did not write there.

Trust: the directory is trusted as the model's files are. A block's CRC32 catches damage, not
tampering: whoever can write the directory can change what the engine serves (use a directory only
the server's user can write).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import IO

from tokenmill.cache.disk_block_file import FORMAT, SUFFIX, TMP_SUFFIX, block_path

logger = logging.getLogger("tokenmill.cache")


class DiskTierError(ValueError):
    """A disk tier that cannot start: the message names the directory and what is wrong."""


METADATA_ERRORS = (OSError, ValueError, TypeError, RecursionError)
"""What reading ``tier.json`` or ``index.json`` raises when the file is missing, unreadable, not JSON, or
nested deeper than the JSON parser goes: read as absent."""
TIER_FILES = {".lock", "tier.json", "index.json", "tier.json" + TMP_SUFFIX, "index.json" + TMP_SUFFIX}
"""The tier's own files besides its blocks and their temporary files."""


def is_tier_file(path: Path) -> bool:
    """Whether ``path`` is one the tier writes: its metadata, or a block (whole or being written) that
    starts as block files do."""
    if path.name in TIER_FILES:
        return True
    if path.suffix not in (SUFFIX, TMP_SUFFIX) or not path.is_file():
        return False
    try:
        with path.open("rb") as file:
            return file.read(len(FORMAT)) == FORMAT
    except OSError:
        return False


def read_namespace(directory: Path) -> str | None:
    """The namespace ``tier.json`` names: the directory's marker (None: not a tier's directory yet)."""
    try:
        held = json.loads((directory / "tier.json").read_text())
    except METADATA_ERRORS:
        return None
    namespace = held.get("namespace") if isinstance(held, dict) else None
    return namespace if isinstance(namespace, str) else None


def take_directory(where: Path, max_bytes: int, block_bytes: int, block_tokens: int) -> IO[bytes]:
    """Create ``where`` if missing and lock it (the lock is held while the returned file is open).
    Raises DiskTierError (nothing left open, nothing in it touched) if it is not usable or writable,
    holds files that are not the tier's and no ``tier.json`` naming a namespace (the tier deletes the
    files it does not want, so it never takes a folder of other files), is locked by another
    tier, or cannot hold ``max_bytes`` (counting the block files there) nor one block of
    ``block_tokens`` tokens (``block_bytes``)."""
    try:
        if where.is_dir() and read_namespace(where) is None:
            others = sorted(p.name for p in where.iterdir() if not is_tier_file(p))
            if others:
                listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
                raise DiskTierError(
                    f"KV disk directory {where} holds files ({listed}) but no tier.json naming a KV tier: the "
                    "tier would delete files it did not write; name an empty or new directory"
                )
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
    if max_bytes < block_bytes + 4096:
        lock_file.close()
        raise DiskTierError(
            f"KV disk directory {where}: kv_cache_disk_bytes {max_bytes} cannot hold one block of "
            f"{block_tokens} tokens ({block_bytes} bytes)"
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


def open_blocks(directory: Path, namespace: str) -> list[tuple[str, int]]:
    """The blocks of ``namespace`` that ``directory`` holds (name, file bytes), least recently used
    first: in the index's order, then those it does not list (written after it), oldest first.

    Deletes the temporary files; if ``tier.json`` names another namespace, deletes every block and
    the index, writes ``namespace`` there and returns no block."""
    held = read_namespace(directory)
    for tmp in directory.glob(f"*{TMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)
    files = {p.stem: p.stat().st_size for p in directory.glob(f"*{SUFFIX}")}
    if held != namespace:
        if files:
            logger.info("disk KV tier: %s held another model's KV (%d blocks): cleared", directory, len(files))
        for name in files:
            block_path(directory, name).unlink(missing_ok=True)
        (directory / "index.json").unlink(missing_ok=True)
        write_namespace(directory, namespace)
        return []
    try:
        order = json.loads((directory / "index.json").read_text())
    except METADATA_ERRORS:
        order = []
    if not isinstance(order, list):
        order = []
    listed = [name for name in order if isinstance(name, str) and name in files]
    unlisted = sorted(set(files) - set(listed), key=lambda name: block_path(directory, name).stat().st_mtime_ns)
    return [(name, files[name]) for name in listed + unlisted]


def write_namespace(directory: Path, namespace: str) -> None:
    """Name ``namespace`` in ``tier.json``: the directory's blocks belong to it."""
    _replace_with(directory / "tier.json", json.dumps({"namespace": namespace}).encode())


def write_index(directory: Path, names: list[str]) -> None:
    """Write ``names`` (the blocks, least recently used first) as the index; a failure is logged."""
    try:
        _replace_with(directory / "index.json", json.dumps(names).encode())
    except OSError as exc:
        logger.warning("disk KV tier: writing its index failed: %s", exc)


def _replace_with(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_bytes(data)
    os.replace(tmp, path)
