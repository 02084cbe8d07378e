"""C++ kernels for CPU (fp32; bf16 where noted), built once per machine as ``torch.ops.tokenmill_cpu``.

``decode_attention.cpp``: paged decode attention over the token-slot KV storage (CpuBackend).
``prefill_attention.cpp``: paged prefill attention over it, every prefill request in one call (CpuBackend).
``kv_int8.cpp``, ``kv_fp8.cpp``: the int8 and fp8 KV caches' store and read (``cache/kv_quant.py``).
``elementwise.cpp``: rms_norm, add_rms_norm, silu_and_mul, rotary_split_qkv (``kernels/fused.py``),
causal_softmax_ (CpuBackend prefill).
``first_maxima.cpp``: each logits row's first maximal entry, the greedy pick (``kernels/first_maxima.py``).
``skinny_linear.cpp``: ``x @ W^T`` for few rows of x (``kernels/linear.py``, decode batches).
``panel_linear.cpp``: ``x @ W^T`` for decode-batch-sized x (``kernels/linear.py``).
``quant_linear.cpp``: products with int8/int4 weights kept quantized (``kernels/quant_linear.py``);
``quant_int8_dot.cpp``: its int8-activation path (AVX512-VNNI), ``quant_int16_dot.cpp`` the same path on
CPUs with AVX2 alone; ``quant_packed.h``: their weight view.
``lora_add.cpp``: a step's LoRA deltas of one projection, every adapter at once (``kernels/lora.py``).
``decode_forward.cpp``: the whole forward of a decode step in one call (``model/decode_forward.py``).
``simd.h``: the vector helpers they share; ``tile16.h``: the fp32 register tile of ``panel_linear.cpp``
and the AVX2 prefill scores; ``kernels.h``: the kernels' C++ entry points; ``linear_io.h``: the linear
kernels' checks and bias.

The sources are compiled by ``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja)
for the host CPU (``-march=native``; ``TOKENMILL_CPU_MARCH`` names another target, e.g. ``x86-64-v3``
for a build every AVX2 machine can run, or to test the AVX2 paths on a newer CPU) with OpenMP, so
``at::parallel_for`` uses torch's threads.
torch caches the build under ``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions``) in a folder
named by :func:`extension_name`, a hash of everything the build depends on (the sources' and headers'
content, the flags, torch's version, the CPU's feature set) and of nothing else (not their path):
checkouts and environments with the same sources share one build, and a build, once there, is
loaded without running the build tool. Only the first run on a machine pays the compile (see
docs/performance.md). ``load_cpu_kernels`` returns None, and logs why, when the build is impossible or
``TOKENMILL_CPU_KERNELS=0`` is set; every caller then uses its torch implementation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from tokenmill.hardware import cpu_flags

logger = logging.getLogger(__name__)


SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "decode_attention.cpp",
        "decode_forward.cpp",
        "elementwise.cpp",
        "first_maxima.cpp",
        "kv_fp8.cpp",
        "kv_int8.cpp",
        "lora_add.cpp",
        "panel_linear.cpp",
        "prefill_attention.cpp",
        "quant_int16_dot.cpp",
        "quant_int8_dot.cpp",
        "quant_linear.cpp",
        "skinny_linear.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name) for name in ("kernels.h", "linear_io.h", "quant_packed.h", "simd.h", "tile16.h")
]
LDFLAGS = ["-fopenmp"]


def compile_flags() -> list[str]:
    """The compiler's flags: for the host CPU, or the target ``TOKENMILL_CPU_MARCH`` names."""
    march = os.environ.get("TOKENMILL_CPU_MARCH", "native")
    return ["-O3", f"-march={march}", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def extension_name(files: list[Path], flags: list[str], cpu_flags: frozenset[str]) -> str:
    """The build's name, which is also its cache folder: a hash of the files' names and contents
    (sources and headers, whose names the sources include), the compile and link flags, torch's
    version and the CPU's feature set, never of a path. Equal inputs give equal names wherever the
    files lie; a change to any of them gives a new name, so a stale build is never loaded. The CPU's
    features are in it because the sources are compiled for the host (``-march=native``): a cache
    folder shared by different machines (a network home) never hands one CPU instructions it lacks."""
    digest = hashlib.sha256()
    for part in (torch.__version__, *flags, *sorted(cpu_flags)):
        digest.update(part.encode() + b"\0")
    for file in sorted(files, key=lambda f: f.name):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return f"tokenmill_cpu_{digest.hexdigest()[:12]}"


_load_lock = threading.Lock()
_state: dict[str, Any] = {"loaded": False, "ops": None}


def _load_built(library: Path) -> bool:
    """Load a finished build (its name vouches for its sources and flags); False if it will not load."""
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:  # a build cut short: build it again
        logger.warning("cannot load %s (%s); rebuilding", library, exc)
        return False
    logger.info("loading the C++ CPU kernels from %s", library.parent)
    return True


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's script folder may not be on it."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load_cpu_kernels() -> Any | None:
    """The ``torch.ops.tokenmill_cpu`` op namespace, or None when the kernels are off or unbuildable.
    Thread-safe; the first call builds or loads, later calls return the result without locking
    (they sit on the forward's hot path: every linear and fused op asks)."""
    if not _state["loaded"]:
        with _load_lock:
            if not _state["loaded"]:
                _state["ops"], _state["loaded"] = _load(), True
    return _state["ops"]


def _load() -> Any | None:
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels disabled by TOKENMILL_CPU_KERNELS=0")
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        cflags = compile_flags()
        name = extension_name(SOURCES + HEADERS, cflags + LDFLAGS, cpu_flags())
        built = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
        building = (built.parent / "lock").exists()  # torch's lock: another process is writing the build
        if built.exists() and not building and _load_built(built):
            return torch.ops.tokenmill_cpu
        # the user sees a pause: say why (WARNING reaches stderr without logging setup)
        logger.warning(
            "building tokenmill's C++ CPU kernels into %s: first use of these sources, ~1 minute", built.parent
        )
        _put_ninja_on_path()
        load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=cflags,
            extra_ldflags=LDFLAGS,
            is_python_module=False,  # the library registers its ops with torch (TORCH_LIBRARY)
        )
        return torch.ops.tokenmill_cpu
    except Exception as exc:  # no compiler, no ninja, no headers: the torch paths still work
        logger.warning("C++ CPU kernels unavailable (%s); using the torch implementations", exc)
        return None
