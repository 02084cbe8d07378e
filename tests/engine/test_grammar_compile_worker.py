"""The grammar compile worker's process: ended by its parent, not by a terminal's Ctrl-C."""

from __future__ import annotations

import os
import signal
import time

from tokenmill.engine.grammar_compile_worker import CompileWorker


def test_a_ctrl_c_to_the_process_group_leaves_the_worker_to_its_parent() -> None:
    worker = CompileWorker()
    try:
        worker._await_ready()  # xgrammar imported, the loop waiting for a request
        os.kill(worker._process.pid, signal.SIGINT)
        time.sleep(1.0)
        assert worker.alive()  # (it exited with a KeyboardInterrupt traceback before)
    finally:
        worker.kill()
    assert not worker.alive()
