"""The C++ kernels' build: its cache folder, named by what the build depends on, never by where the
sources lie; the paths only a build for AVX2 alone compiles, built so on any x86 CPU and tested."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.hardware import avx512
from tokenmill.kernels.cpu import HEADERS, LDFLAGS, SOURCES, compile_flags, extension_name, load_cpu_kernels

FLAGS = compile_flags() + LDFLAGS
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
REPOSITORY = Path(__file__).resolve().parents[2]


def copy_sources(folder: Path) -> list[Path]:
    """A copy of the kernels' sources and headers, as a second checkout or environment holds them."""
    folder.mkdir(parents=True)
    return [Path(shutil.copy2(file, folder)) for file in SOURCES + HEADERS]


def test_checkouts_with_the_same_sources_share_one_build(tmp_path: Path) -> None:
    first, second = copy_sources(tmp_path / "checkout-a"), copy_sources(tmp_path / "venv-b" / "site-packages")
    name = extension_name(first, FLAGS, AVX2)
    assert name == extension_name(second, FLAGS, AVX2) == extension_name(SOURCES + HEADERS, FLAGS, AVX2)
    assert name == extension_name(list(reversed(second)), FLAGS, frozenset(sorted(AVX2, reverse=True)))
    assert name.startswith("tokenmill_cpu_") and name.isidentifier()  # torch names the library and folder by it


def test_any_change_to_what_the_build_reads_gives_a_new_build(tmp_path: Path) -> None:
    sources = copy_sources(tmp_path / "checkout")
    name = extension_name(sources, FLAGS, AVX2)
    header = next(f for f in sources if f.name == "simd.h")  # a header: torch's own check misses these
    header.write_text(header.read_text() + "\n// changed\n")
    names = {
        name,
        extension_name(sources, FLAGS, AVX2),
        extension_name(sources[:-1], FLAGS, AVX2),  # a file less
        extension_name(SOURCES + HEADERS, [*FLAGS, "-DNDEBUG"], AVX2),
        # compiled for the host CPU: a shared home must not hand an AVX2 machine kernels built for AVX-512
        extension_name(SOURCES + HEADERS, FLAGS, AVX2 | {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16"}),
    }
    assert len(names) == 5


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ CPU kernels (a compiler)")
@pytest.mark.skipif(not avx512(), reason="without AVX-512 the native build is the AVX2 one, which every test runs")
def test_the_avx2_build_passes_the_cpu_kernel_tests() -> None:
    """The kernels' code for CPUs with AVX2 alone (the panels layout's int8 products, the attention
    kernels' 256-bit passes) is compiled only there: built for ``x86-64-v3`` (``TOKENMILL_CPU_MARCH``),
    in a process of its own, it passes the CPU attention backend's and the quantized products' tests."""
    tests = ["tests/attention/test_cpu_backend.py", "tests/kernels/test_quantized_linear.py"]
    others = "not the_avx2_build"  # the test comparing this build with the AVX512-VNNI one runs beside this one
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-k", others, *tests]
    env = {**os.environ, "TOKENMILL_CPU_MARCH": "x86-64-v3"}
    run = subprocess.run(command, cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary  # every test ran: the build loaded
