"""HostKVTier: a tier of the KV cache (``cache/kv_tier.py``) in this process's memory, optionally
in front of the disk tier.

It keeps the blocks handed to it (CPU tensors, as ``KVStorage.read_slots`` copies them out of the
cache: on a GPU, device-to-host copies) up to ``max_bytes``, dropping the least recently used
(saved or loaded) past that. With a ``lower`` tier (the disk tier) it is write-through: every block
saved here is also saved there, so a block the host tier drops is still on disk, and the disk tier
keeps its own contracts (background writes, a restart serves its files). A block loaded from the
lower tier is kept here too (the next match reads it from memory). Nothing here survives the
process. All methods run on the engine thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

from tokenmill.cache.kv_tier import KVTier, block_parts, check_block, part_bytes


@dataclass
class HostTierStats:
    """Counters for metrics and tests (reads: blocks served from memory)."""

    query_tokens: int = 0  # prompt tokens looked up past the device's prefix match
    hit_tokens: int = 0  # of which served from host memory
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0  # bytes of blocks taken in (saved, or promoted from the lower tier)
    evicted_blocks: int = 0  # dropped past max_bytes (still in the lower tier if it kept them)


class HostKVTier:
    """Blocks of ``block_shape`` (``[n_layers, block_tokens, n_kv_heads, head_dim]``) keys and values
    of ``dtype`` (int8: with their scales) in memory, at most ``max_bytes``; see the module docstring."""

    def __init__(
        self,
        max_bytes: int,
        namespace: str,
        block_shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        lower: KVTier | None = None,
    ) -> None:
        """Raises ValueError if ``max_bytes`` cannot hold one block, or ``lower`` has another namespace or block."""
        self.namespace = namespace
        self.block_shape = block_shape
        self.max_bytes = max_bytes
        self.parts = block_parts(block_shape, dtype)
        self.payload_bytes = sum(part_bytes(shape, part_dtype) for shape, part_dtype in self.parts)
        if max_bytes < self.payload_bytes:
            raise ValueError(
                f"kv_cache_host_bytes {max_bytes} cannot hold one block of {self.block_tokens} tokens "
                f"({self.payload_bytes} bytes)"
            )
        if lower is not None and (lower.namespace != namespace or lower.payload_bytes != self.payload_bytes):
            raise ValueError("the host tier and the tier below it must hold the same blocks")
        self.lower = lower
        self.stats = HostTierStats()
        self._blocks: OrderedDict[str, tuple[torch.Tensor, ...]] = OrderedDict()  # least recently used first
        self._from_lower: set[str] = set()  # loaded from the lower tier since the last lookup began

    @property
    def block_tokens(self) -> int:
        return self.block_shape[1]

    @property
    def n_blocks(self) -> int:
        return len(self._blocks)

    @property
    def n_bytes(self) -> int:
        return len(self._blocks) * self.payload_bytes

    def holds(self, key: str) -> bool:
        """Whether block ``key`` is in host memory (not counting the lower tier)."""
        return key in self._blocks

    def contains(self, key: str) -> bool:
        return key in self._blocks or (self.lower is not None and self.lower.contains(key))

    def save(self, key: str, *parts: torch.Tensor) -> bool:
        """Keep block ``key`` here (and hand it to the lower tier); False when this tier held it already."""
        check_block(parts, self.parts)
        if self.lower is not None and not self.lower.contains(key):
            self.lower.save(key, *parts)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return False
        self._keep(key, tuple(part.contiguous() for part in parts))
        return True

    def load(self, key: str) -> tuple[torch.Tensor, ...] | None:
        started = time.perf_counter()
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
            self.stats.read_bytes += self.payload_bytes
            self.stats.read_seconds += time.perf_counter() - started
            return block
        block = self.lower.load(key) if self.lower is not None else None
        if block is not None:
            self._keep(key, block)
            self._from_lower.add(key)
        return block

    def record_query(self, n_tokens: int) -> None:
        self._from_lower.clear()
        self.stats.query_tokens += n_tokens
        if self.lower is not None:
            self.lower.record_query(n_tokens)

    def record_hit(self, key: str, n_tokens: int) -> None:
        if key in self._from_lower and self.lower is not None:
            self._from_lower.discard(key)
            self.lower.record_hit(key, n_tokens)
        else:
            self.stats.hit_tokens += n_tokens

    def read_totals(self) -> tuple[int, float]:
        """Bytes loaded and seconds spent, this tier's and the lower tier's together."""
        lower_bytes, lower_seconds = self.lower.read_totals() if self.lower is not None else (0, 0.0)
        return self.stats.read_bytes + lower_bytes, self.stats.read_seconds + lower_seconds

    def snapshot(self) -> dict[str, float]:
        """Counters (``HostTierStats``) with the blocks held, their bytes and the byte budget."""
        return {**asdict(self.stats), "blocks": len(self._blocks), "bytes": self.n_bytes, "max_bytes": self.max_bytes}

    def snapshots(self) -> dict[str, dict[str, float]]:
        return {"host": self.snapshot(), **(self.lower.snapshots() if self.lower is not None else {})}

    def clear(self) -> None:
        self._blocks.clear()
        self._from_lower.clear()
        if self.lower is not None:
            self.lower.clear()

    def renamespace(self, namespace: str) -> None:
        self._blocks.clear()
        self._from_lower.clear()
        self.namespace = namespace
        if self.lower is not None:
            self.lower.renamespace(namespace)

    def close(self) -> None:
        """Close the lower tier (what this one holds is gone with the process)."""
        self._blocks.clear()
        if self.lower is not None:
            self.lower.close()

    def _keep(self, key: str, block: tuple[torch.Tensor, ...]) -> None:
        """Hold ``block`` as the most recently used, dropping the least recently used past ``max_bytes``."""
        self._blocks[key] = block
        self.stats.write_bytes += self.payload_bytes
        while self.n_bytes > self.max_bytes:
            self._blocks.popitem(last=False)
            self.stats.evicted_blocks += 1
