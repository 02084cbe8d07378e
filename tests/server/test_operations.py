"""/health, /version and /metrics (Prometheus text, per-app registry)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

import tokenmill
from tests.server.conftest import MODEL, Server

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: Server) -> Samples:
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_health_and_version(server: Server) -> None:
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json() == {"version": tokenmill.__version__}


def test_metrics_count_a_request_exactly(server: Server) -> None:
    before = scrape(server)
    body = {
        "model": MODEL,
        "prompt": ["hello world", "the cat"],
        "max_tokens": 5,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    usage = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["usage"]
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("tokenmill_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("tokenmill_generation_tokens_total") == usage["completion_tokens"] == 10
    assert delta("tokenmill_finished_completions_total", finish_reason="length") == 2
    assert delta("tokenmill_time_to_first_token_seconds_count") == 2  # one per prompt (engine request)
    assert delta("tokenmill_e2e_request_latency_seconds_count") == 2
    assert delta("tokenmill_inter_token_latency_seconds_count") == 8  # 4 outputs after the first, per request
    assert delta("tokenmill_time_to_first_token_seconds_sum") > 0
    assert after[("tokenmill_num_requests_running", ())] == 0
    assert after[("tokenmill_num_requests_waiting", ())] == 0
    assert 0 <= after[("tokenmill_kv_cache_usage_ratio", ())] <= 1
    assert 0 <= after[("tokenmill_prefix_cache_hit_rate", ())] <= 1
    assert after[("tokenmill_num_preemptions_total", ())] == server.engine.stats()["scheduler"]["preemptions"]
