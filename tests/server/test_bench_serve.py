"""``tokenmill bench serve`` run as a user runs it (the installed script, its own process) against a
live server: every request of the asked workload completes, the reported counts and rates are the
workload's, and the server saw exactly those requests."""

from __future__ import annotations

import json

from tests.server.conftest import Server, wait_until_idle
from tests.test_cli import tokenmill
from tokenmill.bench.workload import make_workload


def test_bench_serve_reports_the_requested_workload(server: Server) -> None:
    before = wait_until_idle(server.engine)["finished_requests"]
    workload = ["--num-prompts", "3", "--prompt-len", "4", "8", "--output-len", "2", "5", "--vocab-size", "97"]
    report = json.loads(tokenmill("bench", "serve", "--url", server.url, *workload, "--json").stdout)
    work = make_workload(3, (4, 8), (2, 5), vocab_size=97, seed=0)  # the command's default seed
    assert report["completed"] == 3 and report["failed"] == 0
    elapsed = report["elapsed_s"]
    assert abs(report["output_tok_per_s"] * elapsed - sum(work.output_lens)) < 1e-6  # greedy, ignore_eos
    assert abs(report["requests_per_s"] * elapsed - 3) < 1e-9
    for latency in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[latency]
        assert set(s) == {"mean", "p50", "p99"} and 0 < s["p50"] <= s["p99"]
    assert wait_until_idle(server.engine)["finished_requests"] == before + 3
