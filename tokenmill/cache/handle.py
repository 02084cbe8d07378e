"""KVHandle: one sequence's hold on the KV cache, owned and written only by the CacheManager.

The engine's sequence keeps a handle and reads it; the cache never sees the engine's types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.cache.radix import RadixNode


@dataclass(eq=False)
class KVHandle:
    """Positions ``0 .. n_kv-1`` of the sequence have slots recorded in request-to-token ``row``."""

    row: int | None = None  # None while the sequence holds no KV (waiting, preempted, finished)
    n_kv: int = 0
    prefix_node: RadixNode | None = None  # radix node locked on behalf of the sequence
    n_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    epoch: int = -1  # the prefix-cache epoch its KV was computed in (see CacheManager.epoch)
    block_keys: list[str] = field(default_factory=list)  # disk-tier names of its whole blocks, as far as computed
    keys_epoch: int = -1  # the epoch ``block_keys`` were computed in
    namespace: str = ""  # the prefix-cache namespace its KV belongs to ("": the base model's; see RadixCache)
