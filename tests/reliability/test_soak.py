"""A short soak for CI (``benchmarks/soak.py`` is the long one): random valid requests through a
live server, then nothing may be left behind — no running request, no row or KV page held
outside the prefix cache, no per-request object alive — and RSS may not grow over a second,
identical batch."""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks.soak import leaks, make_calls, rss_mb, run_calls
from tests.server.conftest import serve
from tests.tiny_models import save_tiny_checkpoint
from tokenmill import Engine

BATCH = 100  # two batches: 200 requests
CONCURRENCY = 16
RSS_GROWTH_LIMIT_MB = 50


def test_soak_leaves_nothing_behind(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path, "llama", max_position_embeddings=512)
    # few KV slots for 16 clients x up to 3 choices: exercises preemption and prefix-cache eviction
    engine = Engine(dtype="float32", model=str(tmp_path), num_kv_slots=256, max_running_requests=32)
    model = tmp_path.name
    with serve(engine) as server:
        baseline = leaks(engine)
        calls = make_calls(BATCH, seed=1234, model=model)
        assert sum(c.leave_after_events is not None or c.leave_after_s is not None for c in calls) > 5

        warmup = asyncio.run(run_calls(server.url, calls, CONCURRENCY))
        assert warmup.errors == [] and warmup.refused == 0, warmup.errors[:5]
        assert warmup.completed + warmup.disconnects == BATCH
        assert leaks(engine) == baseline
        rss_before = rss_mb()

        again = asyncio.run(run_calls(server.url, calls, CONCURRENCY))
        assert again.errors == [] and again.refused == 0, again.errors[:5]
        held = leaks(engine)
        rss_after = rss_mb()
        stats = engine.stats()
    print(
        f"\nsoak: {2 * BATCH} requests, {warmup.disconnects + again.disconnects} disconnects, "
        f"{warmup.seconds:.1f}s + {again.seconds:.1f}s, held after: {held}, "
        f"RSS {rss_before:.1f} -> {rss_after:.1f} MiB ({rss_after - rss_before:+.1f}), "
        f"preemptions {stats['scheduler']['preemptions']}"
    )
    assert held == baseline
    assert held["leaked_rows"] == held["leaked_kv_pages"] == held["active_requests"] == 0
    assert held["live_Sequence"] == held["live_RequestState"] == 0
    assert stats["failed_requests"] == 0
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MB
