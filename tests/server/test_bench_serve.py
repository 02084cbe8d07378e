"""``tokenmill bench serve`` run as a user runs it (the installed script, its own process) against a
live server: every request of the asked workload completes, the reported counts and rates are the
workload's, and the server saw exactly those requests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import uvicorn

from tests.server.conftest import Server, wait_until_idle
from tests.test_cli import tokenmill
from tokenmill import Engine
from tokenmill.bench.workload import make_workload
from tokenmill.server.app import create_app
from tokenmill.server.config import ServerConfig

KEY = "k3y"
REPORT_FIELDS = {
    "completed",
    "failed",
    "elapsed_s",
    "requests_per_s",
    "output_tok_per_s",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "errors",
}
"""The report's fields, as the README describes them."""


def test_bench_serve_reports_the_requested_workload(server: Server) -> None:
    before = wait_until_idle(server.engine)["finished_requests"]
    workload = ["--num-prompts", "3", "--prompt-len", "4", "8", "--output-len", "2", "5", "--vocab-size", "97"]
    report = json.loads(tokenmill("bench", "serve", "--url", server.url, *workload, "--json").stdout)
    work = make_workload(3, (4, 8), (2, 5), vocab_size=97, seed=0)  # the command's default seed
    assert set(report) == REPORT_FIELDS
    assert report["completed"] == 3 and report["failed"] == 0 and report["errors"] == []
    elapsed = report["elapsed_s"]
    assert abs(report["output_tok_per_s"] * elapsed - sum(work.output_lens)) < 1e-6  # greedy, ignore_eos
    assert abs(report["requests_per_s"] * elapsed - 3) < 1e-9
    for latency in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[latency]
        assert set(s) == {"mean", "p50", "p99"} and 0 < s["p50"] <= s["p99"]
    assert wait_until_idle(server.engine)["finished_requests"] == before + 3


class PathRecorder:
    """ASGI wrapper that records the method and path of every HTTP request, then serves it unchanged."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


def test_bench_serve_needs_only_the_openai_routes(checkpoint: Path) -> None:
    """Against a server that requires an API key, the bench sends it and calls nothing but
    ``GET /v1/models`` and ``POST /v1/completions``: it runs unchanged against any OpenAI-compatible server."""
    engine = Engine(dtype="float32", model=str(checkpoint), num_kv_slots=1024)
    recorder = PathRecorder(create_app(engine, ServerConfig(api_key=KEY)))
    server = uvicorn.Server(uvicorn.Config(recorder, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        workload = ["--num-prompts", "3", "--prompt-len", "4", "8", "--output-len", "2", "5", "--vocab-size", "97"]
        result = tokenmill(
            "bench", "serve", "--url", f"http://127.0.0.1:{port}/", "--api-key", KEY, *workload, "--json"
        )
        report = json.loads(result.stdout)
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()
    assert report["completed"] == 3 and report["failed"] == 0 and report["errors"] == []
    assert sorted(set(recorder.seen)) == [("GET", "/v1/models"), ("POST", "/v1/completions")]
    assert recorder.seen.count(("POST", "/v1/completions")) == 3
