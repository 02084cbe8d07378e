"""The second tier of the KV cache an engine's config asks for: host memory, disk, or both."""

from __future__ import annotations

from tokenmill.cache.disk_tier import DiskKVTier
from tokenmill.cache.host_tier import HostKVTier
from tokenmill.cache.kv_tier import BLOCK_TOKENS, KVTier
from tokenmill.cache.storage import KVStorage
from tokenmill.config.cache import CacheOptions


def open_kv_tier(config: CacheOptions, storage: KVStorage, namespace: str) -> KVTier | None:
    """The disk tier (``kv_cache_disk_dir``), the host tier (``kv_cache_host_bytes`` > 0), the host
    tier in front of the disk tier when both are set, or None; blocks of ``max(BLOCK_TOKENS,
    page_size)`` tokens of ``storage``'s layers, heads and dtype. Raises DiskTierError / ValueError
    for a tier that cannot start (nothing left open)."""
    n_layers, _, n_kv_heads, head_dim = storage.k_buffer.shape
    block = (n_layers, max(BLOCK_TOKENS, config.page_size), n_kv_heads, head_dim)
    dtype = storage.k_buffer.dtype
    disk = None
    if config.kv_cache_disk_dir is not None:
        disk = DiskKVTier(config.kv_cache_disk_dir, config.kv_cache_disk_bytes, namespace, block, dtype)
    if config.kv_cache_host_bytes == 0:
        return disk
    try:
        return HostKVTier(config.kv_cache_host_bytes, namespace, block, dtype, lower=disk)
    except ValueError:
        if disk is not None:
            disk.close()
        raise
