"""Builds (once per machine) and loads the C++ CPU attention kernels.

The source is compiled with ``torch.utils.cpp_extension.load`` (ninja and a C++ compiler are
needed) for the host CPU (``-march=native``), with OpenMP so that ``at::parallel_for`` uses
torch's thread pool. The build is cached by torch under ``TORCH_EXTENSIONS_DIR``
(``~/.cache/torch_extensions`` by default), so only the first run on a machine pays the ~1
minute compile. ``load_cpu_kernels`` returns None (and says why in the log) when the build is
impossible, so callers can fall back to the torch-native path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("decode_attention.cpp")]


@functools.cache
def load_cpu_kernels() -> Any | None:
    """The ``torch.ops.tokenmill_cpu`` namespace (``paged_decode_attention``), or None if unbuildable."""
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading the CPU attention kernels (compiled on first use, about a minute)")
        load(
            name="tokenmill_cpu_attention",
            sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # the library registers its ops with torch (TORCH_LIBRARY)
        )
        return torch.ops.tokenmill_cpu
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path still works
        logger.warning("CPU attention kernels unavailable (%s); using the torch-native decode path", exc)
        return None
