"""A checkpoint's fingerprint: names the KV a model computes, so another model's never matches.

Hashes ``config.json`` whole and each weight file's name, size and content sampled at
``SAMPLES`` evenly spaced spans of ``SPAN`` bytes (first and last included), so the cost stays a
few megabytes of reads whatever the model's size; a converted GGUF folder's source file is one of
its weight files. A weight edit that changes no sampled byte and no size goes unnoticed: the
price of not reading every byte at start.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenmill.gguf_checkpoint import read_index

SAMPLES = 64
SPAN = 64 * 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def checkpoint_fingerprint(folder: str | Path, *extra: str) -> str:
    """Hex digest of the checkpoint in ``folder`` and the strings ``extra`` (dtype, KV dtype, ...)."""
    folder = Path(folder)
    digest = hashlib.blake2b(digest_size=16)
    config = folder / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    index = read_index(folder)
    if index is not None:
        files.append(Path(index["file"]))
    for path in files:
        _sample(digest, path)
    for item in extra:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()


def _sample(digest: hashlib.blake2b, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as file:
        for i in range(SAMPLES):
            file.seek(max(0, size - SPAN) * i // (SAMPLES - 1))
            digest.update(file.read(SPAN))
