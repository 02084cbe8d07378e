"""The C++ kernels' build cache folder: named by what the build depends on, never by where the sources lie."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenmill.kernels.cpu import HEADERS, LDFLAGS, SOURCES, compile_flags, extension_name

FLAGS = compile_flags() + LDFLAGS
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})


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
