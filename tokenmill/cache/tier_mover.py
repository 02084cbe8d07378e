"""The KV data the host / disk tier and the storage exchange, as the cache manager queued it."""

from __future__ import annotations

from tokenmill.cache.manager import CacheManager
from tokenmill.cache.storage import KVStorage


def move_tier_blocks(cache: CacheManager, storage: KVStorage) -> None:
    """Hand the tier the blocks the cache queued for it (read from their slots now, before a forward
    can overwrite them), then store the blocks it read into their new slots. Call once a step, after
    scheduling and before the forward, and when the loop goes idle or stops."""
    tier = cache.tier
    if tier is None:
        return
    saves, loads = cache.take_tier_moves()
    for key, slots in saves:
        tier.save(key, *storage.read_slots(slots))
    for load in loads:
        storage.write_slots(load.slots, *load.parts)
