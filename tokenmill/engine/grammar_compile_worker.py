"""Grammar compiles in child processes, so a compile past its time limit is killed, not waited out.

xgrammar's compile is C++ that cannot be interrupted: a pathological spec (thousands of optional
properties on a small vocabulary) runs for minutes. Each compile therefore runs in a
:class:`CompileWorker`, a child Python process at a lower CPU priority (``nice`` +10, so the
engine's threads win the CPUs) that holds xgrammar compilers per tokenizer and returns the
compiled grammar serialized; a compile past its timeout kills the child, and the next compile
starts a fresh one. :class:`CompileWorkerPool` keeps idle workers for reuse across engines.

This file is also the child's program: it is run by path (``runpy``), not imported as part of
the package, so the child imports only the standard library and xgrammar. Requests and replies
are pickled (plain tuples) over two pipes; the child exits when its parent does (pipe closed, or parent gone).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

CHILD_NICENESS = 10
START_TIMEOUT_S = 120.0
"""How long a new child may take to import xgrammar and report ready (not counted in any compile's time)."""
_BOOTSTRAP = "import runpy, sys; del sys.path[0]; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
"""The child's ``-c`` program: run this file as ``__main__`` without the working directory on ``sys.path``."""


@dataclass(frozen=True)
class GrammarSource:
    """What to compile: ``method`` is one of json_schema (compact JSON, strict), json_object (any
    object, compact), regex, ebnf or lark; ``text`` the schema, pattern or grammar."""

    method: str
    text: str


class CompileTimeout(Exception):
    """The compile outlived its timeout; its child was killed."""


class CompileFailed(Exception):
    """xgrammar refused the source; the message is xgrammar's, for a client."""


class CompileWorker:
    """One child process; used by one thread at a time (the pool hands it out)."""

    def __init__(self) -> None:
        parent_reads, child_writes = os.pipe()
        child_reads, parent_writes = os.pipe()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self._process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, __file__, str(child_reads), str(child_writes), str(os.getpid())],
            pass_fds=(child_reads, child_writes),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(child_reads)
        os.close(child_writes)
        self._replies = Connection(parent_reads, writable=False)
        self._requests = Connection(parent_writes, readable=False)
        self._tokenizers: set[str] = set()
        self._ready = False

    def alive(self) -> bool:
        return self._process.poll() is None

    def compile(self, tokenizer_key: str, tokenizer_json: str, source: GrammarSource, timeout: float) -> str:
        """The serialized compiled grammar (``CompiledGrammar.serialize_json``) of ``source`` for the
        tokenizer ``tokenizer_json`` (``TokenizerInfo.serialize_json``, named by ``tokenizer_key``).
        ``timeout`` bounds the compile alone, not the child's start. Raises CompileFailed (the child
        lives on) or CompileTimeout (the child is killed)."""
        self._await_ready()
        known = tokenizer_key in self._tokenizers
        self._send((tokenizer_key, None if known else tokenizer_json, source.method, source.text))
        self._tokenizers.add(tokenizer_key)
        if not self._replies.poll(timeout):
            self.kill()
            raise CompileTimeout(f"no result within {timeout:g}s")
        ok, payload = self._receive()
        if not ok:
            raise CompileFailed(payload)
        return payload

    def kill(self) -> None:
        """Stop the child at once and release its pipes; idempotent."""
        self._process.kill()
        self._process.wait()
        self._replies.close()
        self._requests.close()

    def _await_ready(self) -> None:
        if self._ready:
            return
        if not self._replies.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"the grammar compile process did not start within {START_TIMEOUT_S:g}s")
        ok, payload = self._receive()
        if not ok:
            raise RuntimeError(f"the grammar compile process failed to start: {payload}")
        self._ready = True

    def _send(self, message: object) -> None:
        self._requests.send_bytes(pickle.dumps(message))

    def _receive(self) -> tuple[bool, str]:
        try:
            return pickle.loads(self._replies.recv_bytes())
        except EOFError:
            self.kill()
            raise RuntimeError("the grammar compile process exited unexpectedly") from None


class CompileWorkerPool:
    """Idle :class:`CompileWorker` s, shared by every engine in the process; thread-safe. Callers
    bound how many they hold at once; a killed worker is not returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[CompileWorker] = []

    def acquire(self) -> CompileWorker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
        return CompileWorker()

    def prestart(self) -> None:
        """Start a worker now if none is idle, so that a first compile does not wait for its start."""
        with self._lock:
            if not self._idle:
                self._idle.append(CompileWorker())

    def release(self, worker: CompileWorker) -> None:
        if worker.alive():
            with self._lock:
                self._idle.append(worker)


WORKERS = CompileWorkerPool()


def _serve(requests: Connection, replies: Connection, parent_pid: int) -> None:
    """The child's loop: compile each request, reply ``(True, serialized)`` or ``(False, message)``."""
    os.nice(CHILD_NICENESS)
    # a terminal's Ctrl-C reaches the whole process group: the parent ends this child, not the signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        import xgrammar as xgr
    except Exception as exc:  # reported to the parent, which raises it
        replies.send_bytes(pickle.dumps((False, f"{type(exc).__name__}: {exc}")))
        return
    replies.send_bytes(pickle.dumps((True, "ready")))
    compilers: dict[str, xgr.GrammarCompiler] = {}
    while True:
        try:
            tokenizer_key, tokenizer_json, method, text = pickle.loads(requests.recv_bytes())
        except EOFError:
            return
        if tokenizer_json is not None:
            info = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
            compilers[tokenizer_key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            compiled = _compile(compilers[tokenizer_key], GrammarSource(method, text))
            reply = (True, compiled.serialize_json())
        except Exception as exc:  # a refused source: the message goes to the client
            reply = (False, str(exc))
        replies.send_bytes(pickle.dumps(reply))


def _compile(compiler, source: GrammarSource):  # noqa: ANN001, ANN202 - xgrammar types, imported in the child only
    if source.method == "json_schema":
        return compiler.compile_json_schema(source.text, any_whitespace=False)
    if source.method == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if source.method == "regex":
        return compiler.compile_regex(source.text)
    if source.method == "ebnf":
        return compiler.compile_grammar(source.text)
    if source.method == "lark":
        return compiler.compile_lark(source.text)
    raise ValueError(f"unknown grammar method {source.method!r}")


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ends the child if its parent is gone, even mid-compile (the pipes tell it only between compiles)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False), int(sys.argv[3]))
