"""Graceful shutdown of a real ``tokenmill serve`` process, on SIGTERM and on SIGINT.

With a long and a short streaming request running, the signal must: stop new connections, let
the short request finish normally, keep the long one generating for the grace period and then
end its stream with ``finish_reason: "abort"`` and ``[DONE]`` (not a hang or a cut connection),
and exit the process with code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

import tokenmill
from tests.tiny_models import save_tiny_checkpoint
from tokenmill.server.lifecycle import DrainGate

MODEL = "tiny-llama"
GRACE_S = 3.0
REPO_ROOT = Path(tokenmill.__file__).resolve().parents[1]


@dataclass
class Stream:
    """A streaming completion read in a background thread, with each event's arrival time."""

    url: str
    body: dict
    events: list[tuple[float, str]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json={**self.body, "stream": True}, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line.removeprefix("data: ")))
                        self.started.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.started.set()

    def finish_reason(self) -> str | None:
        assert self.events and self.events[-1][1] == "[DONE]", self.events[-3:]
        return json.loads(self.events[-2][1])["choices"][0]["finish_reason"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shutdown") / MODEL
    save_tiny_checkpoint(path, "llama", max_position_embeddings=8192)
    return path


@contextlib.contextmanager
def server_process(checkpoint: Path, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m tokenmill.cli serve`` on a free loopback port, once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        "--model",
        str(checkpoint),
        "--port",
        str(port),
        "--shutdown-grace-seconds",
        str(GRACE_S),
        "--num-kv-slots",
        "16384",
        "--max-running-requests",
        "8",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"the server exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the server did not come up:\n{log.read_text()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_then_aborts_and_exits_0(checkpoint: Path, tmp_path: Path, sig: signal.Signals) -> None:
    log = tmp_path / "server.log"
    with server_process(checkpoint, log) as (process, url):
        common = {"model": MODEL, "prompt": "hello world", "ignore_eos": True, "temperature": 0}
        long = Stream(url, {**common, "max_tokens": 8000})
        short = Stream(url, {**common, "max_tokens": 60})
        assert long.started.wait(30) and short.started.wait(30)
        assert long.error is None and short.error is None

        signalled = time.monotonic()
        process.send_signal(sig)
        time.sleep(0.5)
        try:  # new connections are refused (or, in the instant before the socket closes, answered 503)
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        except httpx.ConnectError:
            pass
        short.thread.join(GRACE_S + 30)
        long.thread.join(GRACE_S + 30)
        exit_code = process.wait(GRACE_S + 30)

    output = log.read_text()
    assert not long.thread.is_alive() and not short.thread.is_alive(), output
    assert long.error is None and short.error is None, (long.error, short.error, output)
    assert short.finish_reason() == "length"  # finished normally inside the grace period
    assert long.finish_reason() == "abort", output
    ended = long.events[-1][0] - signalled
    assert GRACE_S - 0.5 < ended < GRACE_S + 10, f"the long stream ended {ended:.1f}s after the signal"
    assert sum(t > signalled + 1 for t, _ in long.events) > 10  # it kept generating during the grace period
    assert exit_code == 0, output
    assert "aborted 1 request(s)" in output


def test_a_closed_gate_answers_503_in_the_routes_error_shape() -> None:
    gate = DrainGate(FastAPI(), max_in_flight=8)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://test") as client:
            gate.closed = True
            return (await client.post("/v1/completions", json={}), await client.post("/v1/messages", json={}))

    openai_style, anthropic_style = asyncio.run(run())
    assert openai_style.status_code == anthropic_style.status_code == 503
    assert openai_style.json()["error"]["code"] == "shutting_down"
    assert anthropic_style.json()["error"]["type"] == "overloaded_error"
    assert openai_style.headers["connection"] == "close"
    assert gate.in_flight == 0 and gate.idle.is_set()
