"""CacheOptions: the KV cache's dtype, pages, size, prefix sharing and host / disk tiers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config.dtypes import KV_DTYPES, check_dtype_name
from tokenmill.config.options import option


@dataclass(frozen=True)
class CacheOptions:
    """The KV cache group of :class:`~tokenmill.config.EngineConfig`."""

    kv_cache_dtype: str = option(
        "auto",
        '"auto" (the model\'s dtype), "float32", "bfloat16", "float16" (CPU backends: fp32 or bf16), '
        '"int8" (each token\'s keys and values per KV head as int8 with an fp32 scale: about half of '
        'bf16\'s bytes), "fp8_e4m3" (alias "fp8") or "fp8_e5m2" (one byte a value, a fixed scale of 1: '
        "values beyond the format's range saturate); int8 and fp8 on every backend (the capability "
        "table in docs/ARCHITECTURE.md).",
        section="KV cache",
    )
    page_size: int = option(
        1,
        "Slots per KV page (power of two, 1..256). 1 = token-level allocation.",
        section="KV cache",
    )
    num_kv_slots: int | None = option(
        None,
        "Exact number of KV slots; overrides the memory budget below when set.",
        section="KV cache",
    )
    kv_cache_memory: int | None = option(
        None,
        "KV cache budget in bytes; when None, ``kv_cache_memory_fraction`` of free memory is used.",
        section="KV cache",
    )
    kv_cache_memory_fraction: float | None = option(
        None,
        "Fraction of free memory (after weights) for the KV cache; None = 0.85 on GPU, 0.1 on CPU.",
        section="KV cache",
    )
    max_kv_slots: int = option(
        262_144,
        "Upper bound on slots derived from a memory budget (keeps CPU allocations sane).",
        section="KV cache",
    )
    enable_prefix_caching: bool = option(
        True,
        "Share full KV pages between requests with identical prefixes (radix cache).",
        section="KV cache",
    )
    kv_cache_disk_dir: str | None = option(
        None,
        "Directory of the KV cache's disk tier: prefixes the prefix cache computed are also written "
        "there in the background (blocks of 64 tokens) and read back instead of recomputed, also after "
        "a restart with the same model and settings. One server per directory (locked). None: no tier.",
        section="KV cache",
    )
    kv_cache_disk_bytes: int = option(
        4 * 1024**3,
        "Bytes the disk tier's files may take (least recently used blocks are deleted past it).",
        section="KV cache",
    )
    kv_cache_host_bytes: int = option(
        0,
        "Bytes of this process's memory for a host tier of the KV cache: prefixes the prefix cache "
        "computed are also kept there (blocks of 64 tokens, least recently used dropped past it) and "
        "copied back instead of recomputed; in front of the disk tier when both are set (write-through). "
        "Meant for GPU KV caches (CPU memory beside device memory). 0: no host tier.",
        section="KV cache",
    )

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size > 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two in [1, 256], got {self.page_size}")
        check_dtype_name("kv_cache_dtype", self.kv_cache_dtype, KV_DTYPES)
        if self.kv_cache_memory_fraction is not None and not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.kv_cache_disk_dir is not None and self.kv_cache_disk_bytes < 1:
            raise ValueError(f"kv_cache_disk_bytes must be >= 1, got {self.kv_cache_disk_bytes}")
        if self.kv_cache_host_bytes < 0:
            raise ValueError(f"kv_cache_host_bytes must be >= 0 (0: no host tier), got {self.kv_cache_host_bytes}")
        if self.num_kv_slots is not None and self.num_kv_slots < self.page_size:
            raise ValueError(f"num_kv_slots must be >= page_size ({self.page_size}), got {self.num_kv_slots}")

    @property
    def has_tier(self) -> bool:
        """Whether a host or disk tier is configured."""
        return self.kv_cache_disk_dir is not None or self.kv_cache_host_bytes > 0

    def resolved_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype: the model's for "auto"."""
        return model_dtype if self.kv_cache_dtype == "auto" else KV_DTYPES[self.kv_cache_dtype]
