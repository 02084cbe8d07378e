"""A benchmark's task in a fresh process: each engine alone on the machine, a peer in its own venv.

The benchmark script re-runs itself as ``PYTHON SCRIPT --worker TASK SPEC_FILE ANSWER_FILE``: the
spec and the answer travel as JSON files (a peer may log to stdout). :func:`call` starts it and
returns the answer; :func:`answer` is the worker side.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

Task = Callable[[dict[str, Any]], dict[str, Any]]


def call(
    script: str, python: str, task: str, spec: dict[str, Any], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``task`` of ``script`` run by ``python`` (with ``env`` added) on ``spec``; its answer."""
    with tempfile.TemporaryDirectory() as folder:
        spec_file, answer_file = Path(folder) / "spec.json", Path(folder) / "answer.json"
        spec_file.write_text(json.dumps(spec))
        done = subprocess.run(
            [python, script, "--worker", task, str(spec_file), str(answer_file)],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
        )
        if done.returncode != 0:
            raise RuntimeError(f"{task} failed:\n{done.stderr[-3000:]}")
        return json.loads(answer_file.read_text())


def answer(worker: list[str], tasks: dict[str, Task]) -> None:
    """The worker side: ``worker`` is ``[TASK, SPEC_FILE, ANSWER_FILE]`` (the ``--worker`` values)."""
    task, spec_file, answer_file = worker
    Path(answer_file).write_text(json.dumps(tasks[task](json.loads(Path(spec_file).read_text()))))
