"""What the host CPU can do, read once from the OS (Linux ``/proc/cpuinfo``; elsewhere: nothing).

``native_bf16`` decides ``dtype="auto"`` on CPU: bf16 matmuls run on AMX tiles or AVX512-BF16 dot
products there, and are emulated (far slower than fp32) on CPUs without either.
"""

from __future__ import annotations

import functools
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
