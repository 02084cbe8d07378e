"""The disk tier's block files (``cache/disk_tier.py``): one block's keys and values (int8: and their
scales) per file, named ``<block name>.kv``.

A file is ``FORMAT``, the header's length (uint32, little-endian), a JSON header (the tier's
namespace, the block's name, shape and dtype, and the CRC32 of the payload), then the payload: the
block's parts' bytes, in order. :func:`read_payload` returns a payload only when every header field
is the one expected, the payload is exactly whole and its checksum matches; anything else raises
one of ``READ_ERRORS``. Opening the files is the tier's.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import IO

import numpy as np
import torch

from tokenmill.cache.kv_tier import BlockParts, part_bytes

FORMAT = b"TMKV0001"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_HEADER_LEN = struct.Struct("<I")

READ_ERRORS = (OSError, ValueError, AttributeError, TypeError, RecursionError, struct.error)
"""What reading a block file raises when it is unusable (unreadable, corrupt, truncated, foreign, or a
header nested deeper than the JSON parser goes)."""


def block_path(directory: Path, key: str) -> Path:
    """The file of block ``key`` in ``directory``."""
    return directory / f"{key}{SUFFIX}"


def _fields(namespace: str, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, object]:
    """The header's fields that a reader checks (all but the checksum)."""
    return {"namespace": namespace, "key": key, "shape": list(shape), "dtype": str(dtype)}


def block_contents(
    namespace: str, key: str, shape: tuple[int, ...], dtype: torch.dtype, block: tuple[torch.Tensor, ...]
) -> list[bytes | np.ndarray]:
    """What block ``key``'s file holds, in order: its header, then the bytes of each part of ``block``
    (contiguous CPU tensors; ``shape`` and ``dtype``: the keys' and values')."""
    payloads = [part.view(torch.uint8).numpy() for part in block]
    crc = 0
    for payload in payloads:
        crc = zlib.crc32(payload, crc)
    text = json.dumps({**_fields(namespace, key, shape, dtype), "crc32": crc}).encode()
    return [FORMAT + _HEADER_LEN.pack(len(text)) + text, *payloads]


def read_payload(
    file: IO[bytes], namespace: str, key: str, shape: tuple[int, ...], dtype: torch.dtype, n_bytes: int
) -> bytearray:
    """The ``n_bytes`` payload of ``file``, checked to be whole block ``key`` of ``namespace`` with
    keys and values of ``shape`` and ``dtype``."""
    if file.read(len(FORMAT)) != FORMAT:
        raise ValueError("not a tokenmill KV block")
    (n,) = _HEADER_LEN.unpack(file.read(_HEADER_LEN.size))
    if n > 4096:
        raise ValueError("header too long")
    header = json.loads(file.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    expected = _fields(namespace, key, shape, dtype)
    if any(header.get(name) != value for name, value in expected.items()):
        raise ValueError("written for another model, block or shape")
    payload = bytearray(n_bytes)
    if file.readinto(payload) != n_bytes or file.read(1):
        raise ValueError("truncated or too long")
    if zlib.crc32(payload) != header.get("crc32"):
        raise ValueError("checksum mismatch")
    return payload


def split_payload(payload: bytearray, parts: BlockParts) -> tuple[torch.Tensor, ...]:
    """The block's ``parts`` (shape and dtype of each, in order) as views of ``payload``."""
    flat, views, start = torch.frombuffer(payload, dtype=torch.uint8), [], 0
    for shape, dtype in parts:
        n = part_bytes(shape, dtype)
        views.append(flat[start : start + n].view(dtype).view(shape))
        start += n
    return tuple(views)
