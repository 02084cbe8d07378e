"""A program that builds an engine, generates and exits without calling ``shutdown()`` exits cleanly.

Before the loop was stopped at interpreter exit, about half of such runs from a shell aborted (exit
code 134, "terminate called without an active exception"): the daemon loop thread, still polling
its commands, was frozen mid-call while the interpreter finalized. The abort depends on timing, so
the program also checks the cause directly: an exit handler registered before tokenmill is imported
runs after tokenmill's own, and by then no loop thread may be alive.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiny_models import save_tiny_checkpoint

PROGRAM = """
import atexit, sys, threading

def loop_threads_at_exit():
    alive = [t for t in threading.enumerate() if t.name == "tokenmill-engine" and t.is_alive()]
    print("loop alive" if alive else "loop stopped")

atexit.register(loop_threads_at_exit)  # runs after every handler registered later (tokenmill's)
from tokenmill import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", num_kv_slots=256)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print(len(out[0].outputs[0].token_ids))
"""
RUNS = 2


def test_exiting_without_shutdown_stops_the_loop_and_never_aborts(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path)
    for _ in range(RUNS):
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, timeout=180
        )
        assert (done.returncode, done.stdout.split()) == (0, ["4", "loop", "stopped"]), done.stderr[-2000:]
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
