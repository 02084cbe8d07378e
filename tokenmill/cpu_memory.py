"""Keep the memory a CPU engine's process frees, for its next step (glibc's malloc settings).

glibc hands big blocks back to the OS: a block above its mmap threshold (128 KB at first, adapting
to what is freed) is mapped for each allocation and unmapped when freed, and the top of a heap is
trimmed once enough of it is free. A forward allocates and frees tens of MB of activations a layer,
so with those defaults each step can fault its temporaries in again, a 4 KB page at a time, each
zeroed by the kernel. :func:`keep_freed_memory` sets the thresholds (``mallopt``) so that blocks up
to :data:`MMAP_THRESHOLD_BYTES` come from the heap and freed memory stays there: the process keeps
the resident size of its largest step instead of returning it. Linux with glibc only; elsewhere it
does nothing. The settings are the process's, whatever else runs in it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""
MMAP_THRESHOLD_BYTES = 1 << 30
"""Blocks below this come from the heap (glibc's default adapts up to 32 MB)."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free memory at the top of a heap before it is returned: never, in practice (``mallopt`` takes an int)."""
TOP_PAD_BYTES = 64 << 20
"""Extra address space a heap grows by at a time (pages are only faulted in when used)."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (Linux); else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (once per process); True where it did (Linux
    with glibc, every setting accepted)."""
    libc = _glibc()
    if libc is None:
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def release_freed_memory() -> bool:
    """Return the free memory malloc holds, in every arena, to the OS now (glibc's ``malloc_trim``), so
    that the resident size counts live memory only (a leak check's reading); True where it did."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) in (0, 1)
