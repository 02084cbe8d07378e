"""KVTier: what the cache manager asks of a second tier of the KV cache (host memory, disk).

A tier holds *blocks*: the keys and values of ``block_tokens`` consecutive tokens of a prefix for
every layer (``block_parts`` says their shapes and dtypes), named by a chain hash of all the tokens
up to the block's end under the tier's ``namespace`` (``block_keys``). Every method is
called from the engine thread. Hit accounting: the manager records each lookup's tokens once
(``record_query``: the prompt tokens past the device's match, the same for every tier of a chain) and
each block it uses (``record_hit``: counted by the tier that served it).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

import torch


class KVTier(Protocol):
    namespace: str
    payload_bytes: int  # bytes of one block's parts

    @property
    def block_tokens(self) -> int: ...

    def contains(self, key: str) -> bool:
        """Whether block ``key`` can be loaded (by this tier or one below it)."""
        ...

    def save(self, key: str, *parts: torch.Tensor) -> bool:
        """Take block ``key`` (CPU tensors the caller no longer writes); False when it is not kept."""
        ...

    def load(self, key: str) -> tuple[torch.Tensor, ...] | None:
        """Block ``key``'s parts (not to be written), or None when no tier of the chain holds it."""
        ...

    def record_query(self, n_tokens: int) -> None: ...

    def record_hit(self, key: str, n_tokens: int) -> None:
        """``n_tokens`` of loaded block ``key`` were used instead of computed."""
        ...

    def read_totals(self) -> tuple[int, float]:
        """Bytes loaded and seconds spent loading them, over the chain (the speed a load is priced at)."""
        ...

    def snapshots(self) -> dict[str, dict[str, float]]:
        """Each tier of the chain's counters, by tier name (``"host"``, ``"disk"``)."""
        ...

    def clear(self) -> None:
        """Delete every block of the chain."""
        ...

    def renamespace(self, namespace: str) -> None:
        """Serve ``namespace`` from now on (the weights changed): every block of the chain is deleted."""
        ...

    def close(self) -> None: ...


BLOCK_TOKENS = 64
"""Tokens of a block (or a page, if larger)."""

BlockParts = list[tuple[tuple[int, ...], torch.dtype]]
"""Each part of a block: its shape and dtype."""


def block_parts(block_shape: tuple[int, int, int, int], dtype: torch.dtype) -> BlockParts:
    """The shapes and dtypes of a block's parts: keys, values ``block_shape`` (``[n_layers,
    block_tokens, n_kv_heads, head_dim]``) of ``dtype`` (fp8: its bytes alone, ``cache/kv_fp8.py``),
    and for int8 their fp32 scales (``[n_layers, block_tokens, n_kv_heads]`` each, ``cache/kv_quant.py``)."""
    scales = [(block_shape[:3], torch.float32)] * 2 if dtype == torch.int8 else []
    return [(block_shape, dtype)] * 2 + scales


def part_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def check_block(parts: tuple[torch.Tensor, ...], expected: BlockParts) -> None:
    """Raise ValueError unless ``parts`` have the ``expected`` shapes and dtypes."""
    if len(parts) != len(expected):
        raise ValueError(f"a block has {len(expected)} parts (keys, values, int8 scales), got {len(parts)}")
    for part, (shape, dtype) in zip(parts, expected):
        if part.shape != shape or part.dtype != dtype:
            raise ValueError(f"a block part is {shape} {dtype}, got {tuple(part.shape)} {part.dtype}")


def block_keys(root: str, tokens: Sequence[int], block_tokens: int, known: list[str]) -> list[str]:
    """The names of the whole blocks of ``tokens``: ``known`` (a list of those computed before, for
    the same tokens and root) extended in place and returned."""
    for b in range(len(known), len(tokens) // block_tokens):
        previous = known[b - 1] if b else root
        block = struct.pack(f"<{block_tokens}q", *tokens[b * block_tokens : (b + 1) * block_tokens])
        known.append(hashlib.blake2b(previous.encode() + block, digest_size=16).hexdigest())
    return known
