"""What the host CPU can do, read from the OS (Linux ``/proc/cpuinfo``; elsewhere: nothing), and how
many CPUs this process may use.

``native_bf16`` decides ``dtype="auto"`` on CPU: bf16 matmuls run on AMX tiles or AVX512-BF16 dot
products there, and are emulated (far slower than fp32) on CPUs without either. ``usable_cpus``
bounds the engine's threads: the affinity mask and the cgroup quota, not the machine's CPU count.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of the first processor listed (empty where the OS does not say)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def avx512() -> bool:
    """True when the CPU has AVX-512 (16-wide fp32 vectors)."""
    return "avx512f" in cpu_flags()


def avx512_bf16() -> bool:
    """True when the CPU has AVX512-BF16 dot products (the C++ kernels' bf16 weight stream uses them)."""
    return "avx512_bf16" in cpu_flags()


def native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AMX-BF16 or AVX512-BF16)."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: those of its affinity mask, capped by its cgroup's CPU quota
    (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, rounded up); at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _cgroup_quota(root: Path) -> float | None:
    """The cgroup's CPU quota in CPUs (None: no quota, or no cgroup file readable)."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        v1_quota, v1_period = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if v1_quota.is_file() and v1_period.is_file():
            quota_us = int(v1_quota.read_text())
            return None if quota_us <= 0 else quota_us / int(v1_period.read_text())
    except (OSError, ValueError):
        return None
    return None
