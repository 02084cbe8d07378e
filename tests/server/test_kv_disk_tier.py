"""The KV host and disk tiers behind the HTTP server: a restarted server serves a repeated prompt's
prefix from disk (``cached_tokens`` in the official client's usage, the same text) and keeps it in
host memory, the tiers' metrics and status, and ``POST /reset_prefix_cache`` (API key required)
clearing every tier."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import openai

from tests.server.conftest import MODEL, serve
from tokenmill import Engine
from tokenmill.cache.disk_block_file import SUFFIX

KEY = "tier-key"
PROMPT = [random.Random(7).randrange(4, 97) for _ in range(300)]


def complete(url: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens


def tier_metric(url: str, name: str, tier: str = "disk") -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{tier="{tier}"}}'))
    return float(line.split()[-1])


def test_restarted_server_serves_the_prefix_from_disk(checkpoint: Path, tmp_path: Path) -> None:
    def engine() -> Engine:
        return Engine(
            dtype="float32",
            model=str(checkpoint),
            num_kv_slots=4096,
            kv_cache_disk_dir=str(tmp_path),
            kv_cache_host_bytes=2**24,
        )

    with serve(engine(), api_key=KEY) as live:
        text, cached = complete(live.url)
        assert cached == 0
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 4
    with serve(engine(), api_key=KEY) as live:
        again, cached = complete(live.url)
        assert (again, cached) == (text, 256)
        assert tier_metric(live.url, "tokenmill_kv_tier_hit_tokens_total") == 256
        assert tier_metric(live.url, "tokenmill_kv_tier_bytes") > 0
        status = httpx.get(f"{live.url}/status", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert status["kv_cache_dtype"] == "float32"
        assert status["disk_tier"]["blocks"] == 4 and status["disk_tier"]["hit_rate"] == 256 / 299
        assert status["host_tier"]["blocks"] == 4 and status["host_tier"]["hit_rate"] == 0.0  # kept from disk
        assert tier_metric(live.url, "tokenmill_kv_tier_hit_tokens_total", "host") == 0
        assert tier_metric(live.url, "tokenmill_kv_tier_bytes", "host") > 0
        assert httpx.post(f"{live.url}/reset_prefix_cache").status_code == 401
        reply = httpx.post(f"{live.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
        assert reply.status_code == 200 and reply.json() == {"success": True}
        assert not list(tmp_path.glob(f"*{SUFFIX}"))
        assert tier_metric(live.url, "tokenmill_kv_tier_bytes", "host") == 0
        assert complete(live.url) == (text, 0)
