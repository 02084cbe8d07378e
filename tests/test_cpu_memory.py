"""The CPU engine's process keeps freed memory for reuse: a freed 40 MB block (above glibc's adaptive
mmap threshold, which stops at 32 MB) comes back without page faults once ``keep_freed_memory`` ran,
where by default every 4 KB page of it faults again. Each case runs in a fresh interpreter: the
malloc settings are the whole process's and cannot be undone. Measured as a step repeats: the first
reuses after the setting (or after an engine's start) may still land on fresh address space while
the heap settles (up to three of them, measured); from the fifth on, none faults (a step's
temporaries are reused)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.default_model import TINY_MODEL_DIR

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc (Linux): mallopt")

FAULTS_OF_REUSE = """
import resource, sys, torch

def faults_of_reuse() -> int:
    torch.empty(40 << 20, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(40 << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""


def run(script: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", FAULTS_OF_REUSE + script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_freed_blocks_are_reused_without_page_faults_once_kept() -> None:
    default, applied, *kept = run(
        "from tokenmill.cpu_memory import keep_freed_memory\n"
        "print(faults_of_reuse(), keep_freed_memory(), *[faults_of_reuse() for _ in range(8)])"
    )
    assert int(default) >= 5000  # ~10240: every 4 KB page of 40 MB
    assert applied == "True" and all(int(n) < 100 for n in kept[4:])


@pytest.mark.parametrize("keep", [True, False])
def test_a_cpu_engine_keeps_freed_memory_unless_told_not_to(keep: bool) -> None:
    faults = run(
        "from tokenmill import LLM\n"
        f"llm = LLM(model={str(Path(TINY_MODEL_DIR))!r}, cpu_keep_freed_memory={keep})\n"
        "print(*[faults_of_reuse() for _ in range(8)])\n"
        "llm.shutdown()"
    )
    assert all(int(n) < 100 for n in faults[4:]) if keep else all(int(n) >= 5000 for n in faults)
