"""/health, /version and /metrics (Prometheus text, per-app registry)."""

from __future__ import annotations

import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

import tokenmill
from tests.server.conftest import MODEL, Server, wait_until_idle
from tokenmill import SamplingParams
from tokenmill.request import RequestOutput

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
    before, stats_before = scrape(server), server.engine.stats()
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
    stats = server.engine.stats()
    assert after[("tokenmill_num_preemptions_total", ())] == stats["scheduler"]["preemptions"]
    # idle: the pages in use are exactly those the prefix cache keeps, now also the two new sequences' (page size 1:
    # one page per token whose KV was computed, every token but each sequence's last); no live request holds any,
    # so KV usage is 0 and they all count as reclaimable prefix-cache pages
    used = stats["kv_capacity_pages"] - stats["kv_free_pages"]
    assert used == stats["kv_cached_pages"] == stats_before["kv_cached_pages"] + usage["total_tokens"] - 2
    assert after[("tokenmill_kv_cache_usage_ratio", ())] == 0.0 == stats["kv_usage"]
    assert after[("tokenmill_prefix_cache_usage_ratio", ())] == used / stats["kv_capacity_pages"] > 0

    # the same prompts again: every prompt token but the last (always recomputed) comes from the prefix cache
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["usage"]
    later, stats_later = scrape(server), server.engine.stats()
    cache, cache_later = stats["cache"], stats_later["cache"]
    looked_up = cache_later["prefix_query_tokens"] - cache["prefix_query_tokens"]
    assert looked_up == cache_later["prefix_hit_tokens"] - cache["prefix_hit_tokens"] == again["prompt_tokens"] - 2
    hit_rate = cache_later["prefix_hit_tokens"] / cache_later["prefix_query_tokens"]
    assert later[("tokenmill_prefix_cache_hit_rate", ())] == hit_rate > after[("tokenmill_prefix_cache_hit_rate", ())]


def test_kv_usage_counts_live_requests_and_the_prefix_cache_apart(server: Server) -> None:
    """``tokenmill_kv_cache_usage_ratio`` counts the pages live requests hold (shared prefix pages
    once); pages only the prefix cache holds are reclaimable: ``tokenmill_prefix_cache_usage_ratio``."""
    engine = server.engine
    idle = wait_until_idle(engine)
    capacity, cached = idle["kv_capacity_pages"], idle["kv_cached_pages"]
    prompt = list(range(40, 70))  # never served before: no prefix hit
    first_delta = threading.Event()
    finished = threading.Event()

    def pause_after_first_token(delta: RequestOutput) -> None:
        # on the engine thread, between steps: what pause_generation's command does, without racing the next step
        if not first_delta.is_set():
            engine._paused = True
            first_delta.set()
        if delta.finished:
            finished.set()

    engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), pause_after_first_token)
    assert first_delta.wait(30)
    try:
        running, stats = scrape(server), engine.stats()
        assert stats["running"] == 1
        # page size 1: the request holds one page per prompt token (its first sampled token has no KV yet); the
        # prefix cache stores those too (shared, so live) besides the pages of earlier requests (reclaimable)
        assert stats["kv_cached_pages"] == cached + len(prompt)
        assert running[("tokenmill_kv_cache_usage_ratio", ())] == len(prompt) / capacity == stats["kv_usage"]
        assert running[("tokenmill_prefix_cache_usage_ratio", ())] == cached / capacity
    finally:
        assert httpx.post(f"{server.url}/resume_generation").json()["paused"] is False
    assert finished.wait(30)
    idle = wait_until_idle(engine)
    after = scrape(server)
    assert after[("tokenmill_kv_cache_usage_ratio", ())] == 0.0 == idle["kv_usage"]
    reclaimable = idle["kv_cached_pages"] / capacity
    assert after[("tokenmill_prefix_cache_usage_ratio", ())] == reclaimable == idle["kv_prefix_cache_usage"] > 0
