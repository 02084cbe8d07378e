"""The default model's corpus: the Python standard library's own sources.

Shared by ``train_default_model.py`` and ``measure_perplexity.py``: which files are used, the
deterministic train/validation split, and packing of token documents into fixed-length windows.
"""

from __future__ import annotations

import hashlib
import sysconfig
import tokenize
from pathlib import Path

import torch
from torch import Tensor

EXCLUDED_DIRS = frozenset(
    {
        "__phello__",
        "encodings",
        "ensurepip",
        "idlelib",
        "lib2to3",
        "pydoc_data",
        "site-packages",
        "test",
        "tests",
        "turtledemo",
    }
)
VALIDATION_MODULUS = 20  # one file in twenty (~5%) is held out for validation


def stdlib_root() -> Path:
    """Directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[str]:
    """Sorted relative paths of the stdlib ``.py`` files used as the corpus."""
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = rel.parts[:-1]
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in parts):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def is_validation_file(rel_path: str) -> bool:
    """Deterministic held-out split keyed on the file's path relative to the stdlib root."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % VALIDATION_MODULUS == 0


def read_source(path: Path) -> str | None:
    """Read a Python source file honouring its encoding cookie; ``None`` if unreadable."""
    try:
        with tokenize.open(path) as handle:
            return handle.read()
    except (SyntaxError, UnicodeDecodeError):
        return None


def load_split(root: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Return ``(train, validation)`` mappings of relative path to source text."""
    root = root or stdlib_root()
    train: dict[str, str] = {}
    validation: dict[str, str] = {}
    for rel in corpus_files(root):
        text = read_source(root / rel)
        if text and text.strip():
            (validation if is_validation_file(rel) else train)[rel] = text
    return train, validation


def pack_stream(documents: list[list[int]], eos_id: int) -> Tensor:
    """Concatenate token documents into one stream, each preceded by the EOS separator."""
    stream: list[int] = []
    for doc in documents:
        stream.append(eos_id)
        stream.extend(doc)
    return torch.tensor(stream, dtype=torch.long)


def stream_windows(stream: Tensor, seq_len: int, drop_last: bool) -> list[Tensor]:
    """Split a stream into windows of ``seq_len + 1`` tokens overlapping by one token.

    Every token after the first is a prediction target exactly once; with ``drop_last``
    a final shorter window is discarded.
    """
    windows = []
    for start in range(0, len(stream) - 1, seq_len):
        window = stream[start : start + seq_len + 1]
        if len(window) == seq_len + 1 or not drop_last:
            windows.append(window)
    return windows
