"""Keeps a benchmark run's raw result as a JSON file under ``benchmarks/results/``.

Each script calls ``save(name, result)`` where it prints its final summary; the file is
``<YYYY-MM-DD>-<cpu>-<isa>-<name>.json`` (``-2``, ``-3``, ... when that name is taken), e.g.
``2025-06-01-intel-xeon-processor-avx512-vnni-kv-int8.json``, and holds the benchmark's name, the
time, the CPU, the command line and the result. Only the standard library is imported at the top:
the scripts' workers import their script (and so this module) in venvs without tokenmill.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# the flags that tell the CPU's vector and matrix units apart (model names such as "Intel Xeon
# Processor" do not), best first: the first class whose flags the CPU lists names the file
ISA_CLASSES = (
    ("amx", ("amx_tile",)),
    ("avx512-vnni", ("avx512_vnni",)),
    ("avx512", ("avx512f",)),
    ("avx2", ("avx2",)),
    ("neon", ("asimd",)),
)
FLAGS_OF_INTEREST = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "sve",
)


def slug(text: str) -> str:
    """``text`` lowercased, each run of characters other than letters and digits one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``model name`` of /proc/cpuinfo; else what ``platform`` says)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def isa_class(flags: frozenset[str]) -> str:
    """The best vector/matrix unit class the flags show: amx, avx512-vnni, avx512, avx2, neon or other."""
    return next((name for name, needed in ISA_CLASSES if all(f in flags for f in needed)), "other")


def cpu_info() -> dict[str, Any]:
    """The CPU a run ran on: model name, ISA class, flags of interest, logical and usable CPUs."""
    from tokenmill.hardware import cpu_flags, usable_cpus

    flags = cpu_flags()
    return {
        "model_name": cpu_model_name(),
        "isa": isa_class(flags),
        "flags": [flag for flag in FLAGS_OF_INTEREST if flag in flags],
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
    }


def cpu_slug(cpu: dict[str, Any]) -> str:
    """The CPU part of a file name: the model name's slug (``(R)``, ``(TM)``, ``CPU`` and the clock
    left out) and the ISA class, e.g. ``intel-xeon-processor-avx512-vnni``."""
    name = re.sub(r"\((?:r|tm)\)|\bcpu\b|@.*$", " ", cpu["model_name"], flags=re.IGNORECASE)
    return "-".join(part for part in (slug(name)[:60].strip("-"), cpu["isa"]) if part)


def save(name: str, result: Any, folder: Path | None = None) -> Path:
    """Writes ``result`` (what the benchmark printed) to a new file in ``folder`` (default:
    ``benchmarks/results/``), says where on stderr and returns the path; an existing file is never
    overwritten."""
    folder = RESULTS_DIR if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.now().astimezone()
    cpu = cpu_info()
    record = {
        "benchmark": name,
        "date": now.isoformat(timespec="seconds"),
        "cpu": cpu,
        "command": list(sys.argv),
        "result": result,
    }
    text = json.dumps(record, indent=1, default=str) + "\n"
    stem = f"{now:%Y-%m-%d}-{cpu_slug(cpu)}-{slug(name) or 'benchmark'}"
    for n in range(1, 10_000):
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with path.open("x") as f:  # "x": fails on an existing file, so two runs never share one
                f.write(text)
        except FileExistsError:
            continue
        print(f"raw result saved to {path}", file=sys.stderr)
        return path
    raise FileExistsError(f"{folder}: no free name for {stem}.json")
