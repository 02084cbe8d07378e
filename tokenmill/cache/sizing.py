"""How many KV slots to allocate: an explicit count, or a memory budget / bytes per slot."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.cache.storage import KVStorage
from tokenmill.config.cache import CacheOptions

DEFAULT_FRACTION = {"cuda": 0.85, "cpu": 0.1}


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now (CUDA: driver free; CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * 1024**3


def kv_cache_slots(
    config: CacheOptions, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Slots for the KV cache of a model of that shape, a multiple of ``page_size`` holding at
    least one usable page."""
    if config.num_kv_slots is not None:
        slots = config.num_kv_slots
    else:
        per_slot = KVStorage.bytes_per_slot(n_layers, n_kv_heads, head_dim, dtype)
        budget = config.kv_cache_memory
        if budget is None:
            fraction = config.kv_cache_memory_fraction or DEFAULT_FRACTION.get(device.type, 0.1)
            budget = int(free_memory_bytes(device) * fraction)
        slots = min(budget // per_slot, config.max_kv_slots)
    slots = slots // config.page_size * config.page_size
    if slots < 2 * config.page_size:
        raise ValueError(
            f"KV cache too small: {slots} slots (need at least 2 pages of {config.page_size}); "
            "raise num_kv_slots or kv_cache_memory"
        )
    return slots
