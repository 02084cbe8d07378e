"""Soak: random valid requests through a live server, then a check that nothing leaked.

Requests go to ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/messages`` over loopback
at bounded concurrency (asyncio + httpx), with random parameters: streaming or not, ``n`` in
1..3, stop strings, ``max_tokens`` 1..16, temperature / top_p / seed, sometimes logprobs and
penalties, and clients that leave mid-stream (or before a non-streamed answer). Every answer
is checked: complete and well-formed (a finish reason for each choice) or a clean error status.

Afterwards the engine must be idle with nothing held (no running or waiting request, every
request-table row free, KV pages in use == pages held by the prefix cache), no per-request
object may survive a garbage collection, and RSS growth over a second batch after a warm-up
must stay bounded. The engine and uvicorn run in this process, so the RSS is the server's plus
the client's.

    python benchmarks/soak.py --requests 5000 --concurrency 32          # bundled default model
    python benchmarks/soak.py --model path/to/checkpoint --requests 20000 --json

On a busy CPU, ``OMP_NUM_THREADS=1`` keeps torch's OpenMP threads from spin-waiting on each other.
Exit status 1 when a request got a malformed answer or anything was left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenmill import Engine
from tokenmill.engine.intake import RequestState
from tokenmill.engine.sequence import Sequence
from tokenmill.server.background import serve_in_background
from tokenmill.server.generation import Generation

WORDS = ["hello", "world", "the", "cat", "dog", "sat", "on", "mat", "one", "two", "three", "def", "return", "x"]
OPENAI_FINISH = {"stop", "length"}
ANTHROPIC_STOP = {"end_turn", "max_tokens", "stop_sequence"}
PER_REQUEST_TYPES = (Sequence, RequestState, Generation)


@dataclass
class Call:
    """One request of the workload: the body, and when (if ever) the client walks away."""

    path: str
    body: dict[str, Any]
    choices: int  # choices a complete answer must carry
    leave_after_events: int | None = None  # streaming: close after this many events
    leave_after_s: float | None = None  # not streaming: give up after this long


@dataclass
class SoakResult:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    refused: int = 0  # clean error statuses (error JSON in the route's shape)
    errors: list[str] = field(default_factory=list)  # malformed answers, 5xx, transport failures
    seconds: float = 0.0


def make_calls(n: int, seed: int, model: str, words: list[str] = WORDS) -> list[Call]:
    """``n`` random valid requests; the same ``seed`` gives the same requests."""
    rng = random.Random(seed)
    return [_random_call(rng, model, words) for _ in range(n)]


def _random_call(rng: random.Random, model: str, words: list[str]) -> Call:
    prompt = " ".join(rng.choices(words, k=rng.randint(1, 12)))
    stream = rng.random() < 0.5
    sampling: dict[str, Any] = {"max_tokens": rng.randint(1, 16)}
    if rng.random() < 0.7:
        sampling["temperature"] = rng.choice([0.0, round(rng.uniform(0.1, 1.5), 3)])
    if rng.random() < 0.4:
        sampling["top_p"] = round(rng.uniform(0.05, 1.0), 3)
    stop = rng.sample(words, rng.randint(0, 2))
    kind = rng.choice(["chat", "completions", "messages"])
    if kind == "messages":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream, **sampling}
        if stop:
            body["stop_sequences"] = stop
        choices = 1
    else:
        n = rng.randint(1, 3)
        sampling.update(n=n, stream=stream)
        if rng.random() < 0.5:
            sampling["seed"] = rng.randrange(2**31)
        if stop:
            sampling["stop"] = stop
        if rng.random() < 0.2:
            sampling["presence_penalty"] = round(rng.uniform(-2, 2), 2)
            sampling["repetition_penalty"] = round(rng.uniform(0.5, 2), 2)
        if stream and rng.random() < 0.5:
            sampling["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], **sampling}
            if rng.random() < 0.2:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
            choices = n
        else:
            prompts = [prompt] if rng.random() < 0.8 else [prompt, " ".join(rng.choices(words, k=3))]
            body = {"model": model, "prompt": prompts if len(prompts) > 1 else prompt, **sampling}
            if rng.random() < 0.2:
                body["logprobs"] = rng.randint(0, 3)
            choices = n * len(prompts)
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages"}[kind]
    call = Call(path, body, choices)
    if stream and rng.random() < 0.15:
        call.leave_after_events = rng.randint(1, 4)
    elif not stream and rng.random() < 0.05:
        call.leave_after_s = rng.uniform(0.0, 0.05)
    return call


# ------------------------------------------------------------------------------------ answer checks
def _check_json(call: Call, data: dict[str, Any]) -> str | None:
    """Why a non-streamed answer is incomplete or malformed; None if it is fine."""
    if call.path == "/v1/messages":
        if data.get("type") != "message" or data.get("stop_reason") not in ANTHROPIC_STOP:
            return f"bad message: {data}"
        if [block["type"] for block in data["content"]] != ["text"]:
            return f"bad content: {data['content']}"
        return None
    choices = data.get("choices", [])
    if sorted(c["index"] for c in choices) != list(range(call.choices)):
        return f"expected {call.choices} choices, got {choices}"
    if any(c["finish_reason"] not in OPENAI_FINISH for c in choices):
        return f"choice without a finish reason: {choices}"
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    if not all(isinstance(t, str) for t in texts) or "usage" not in data:
        return f"malformed answer: {data}"
    return None


def _check_stream(call: Call, events: list[tuple[str | None, str]]) -> str | None:
    """Why a complete SSE stream (``(event, data)`` pairs) is malformed; None if it is fine."""
    if call.path == "/v1/messages":
        kinds = [json.loads(data)["type"] for _, data in events]
        if not kinds or kinds[0] != "message_start" or kinds[-1] != "message_stop" or "error" in kinds:
            return f"bad event sequence: {kinds}"
        final = next(json.loads(d) for _, d in events if json.loads(d)["type"] == "message_delta")
        return None if final["delta"]["stop_reason"] in ANTHROPIC_STOP else f"bad stop: {final}"
    if not events or events[-1][1] != "[DONE]":
        return "stream does not end with [DONE]"
    finishes: Counter[int] = Counter()
    for _, data in events[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:
            return f"stream error: {chunk}"
        for choice in chunk["choices"]:
            if choice["finish_reason"] is not None:
                if choice["finish_reason"] not in OPENAI_FINISH:
                    return f"bad finish reason: {choice}"
                finishes[choice["index"]] += 1
    if finishes != Counter(range(call.choices)):
        return f"expected one finish per choice of {call.choices}, got {dict(finishes)}"
    return None


def _is_clean_error(call: Call, response: httpx.Response) -> bool:
    try:
        data = response.json()
    except ValueError:
        return False
    if call.path == "/v1/messages":
        return data.get("type") == "error" and bool(data.get("error", {}).get("message"))
    return bool(data.get("error", {}).get("message"))


# ------------------------------------------------------------------------------------------ client
async def _one(client: httpx.AsyncClient, url: str, call: Call, result: SoakResult) -> None:
    try:
        if call.body.get("stream"):
            outcome = await _streamed(client, url, call)
        elif call.leave_after_s is not None:
            try:
                outcome = await asyncio.wait_for(_plain(client, url, call), call.leave_after_s)
            except asyncio.TimeoutError:
                outcome = "left"
        else:
            outcome = await _plain(client, url, call)
    except httpx.HTTPError as exc:
        outcome = f"transport error: {type(exc).__name__}: {exc}"
    if outcome is None:
        result.completed += 1
    elif outcome == "left":
        result.disconnects += 1
    elif outcome == "refused":
        result.refused += 1
    else:
        result.errors.append(f"{call.path} {json.dumps(call.body)}: {outcome}")


async def _plain(client: httpx.AsyncClient, url: str, call: Call) -> str | None:
    response = await client.post(url + call.path, json=call.body)
    if response.status_code != 200:
        return _refusal(call, response)
    return _check_json(call, response.json())


def _refusal(call: Call, response: httpx.Response) -> str:
    if response.status_code < 500 and _is_clean_error(call, response):
        return "refused"
    return f"status {response.status_code}: {response.text[:300]}"


async def _streamed(client: httpx.AsyncClient, url: str, call: Call) -> str | None:
    async with client.stream("POST", url + call.path, json=call.body) as response:
        if response.status_code != 200:
            await response.aread()
            return _refusal(call, response)
        events: list[tuple[str | None, str]] = []
        event: str | None = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, line[6:]))
                event = None
                if call.leave_after_events is not None and len(events) >= call.leave_after_events:
                    return "left"  # leaving the block closes the connection mid-stream
    return _check_stream(call, events)


async def run_calls(url: str, calls: list[Call], concurrency: int) -> SoakResult:
    """Send ``calls`` to the server at ``url``, at most ``concurrency`` at a time."""
    result = SoakResult(requests=len(calls))
    limit = asyncio.Semaphore(concurrency)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def limited(call: Call) -> None:
            async with limit:
                await _one(client, url, call, result)

        await asyncio.gather(*(limited(call) for call in calls))
    result.seconds = time.monotonic() - started
    return result


# ------------------------------------------------------------------------------------ leak checks
def wait_until_idle(engine: Engine, timeout: float = 60) -> dict[str, Any]:
    """``engine.stats()`` once nothing runs and only the prefix cache holds KV (aborts land a step late)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        held = stats["kv_capacity_pages"] - stats["kv_free_pages"] - stats["kv_cached_pages"]
        if stats["running"] == stats["waiting"] == stats["active_requests"] == 0 and held == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def leaks(engine: Engine) -> dict[str, int]:
    """What the engine still holds once idle, and the live per-request objects after a collection."""
    stats = wait_until_idle(engine)
    gc.collect()
    live = Counter(type(obj).__name__ for obj in gc.get_objects() if type(obj) in PER_REQUEST_TYPES)
    return {
        "running": stats["running"],
        "waiting": stats["waiting"],
        "active_requests": stats["active_requests"],
        "leaked_rows": engine.config.max_running_requests - stats["free_rows"],
        "leaked_kv_pages": stats["kv_capacity_pages"] - stats["kv_free_pages"] - stats["kv_cached_pages"],
        **{f"live_{cls.__name__}": live[cls.__name__] for cls in PER_REQUEST_TYPES},
    }


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@contextlib.contextmanager
def serving(engine: Engine, **app_options: Any) -> Iterator[str]:
    """Serve ``engine`` on a free loopback port in a background thread; yields the base URL."""
    with serve_in_background(engine, **app_options) as port:
        yield f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the first RSS reading")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-slots", type=int, default=8192)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    engine = Engine(model=args.model, num_kv_slots=args.num_kv_slots)
    model = engine.config.model_path().name
    try:
        with serving(engine) as url:
            warm = asyncio.run(run_calls(url, make_calls(args.warmup, args.seed, model), args.concurrency))
            leaks(engine)
            rss_before = rss_mb()
            soak = asyncio.run(run_calls(url, make_calls(args.requests, args.seed + 1, model), args.concurrency))
            held = leaks(engine)
            rss_after = rss_mb()
    finally:
        engine.shutdown()
    report = {
        "requests": soak.requests,
        "completed": soak.completed,
        "disconnects": soak.disconnects,
        "refused": soak.refused,
        "errors": len(soak.errors),
        "seconds": round(soak.seconds, 1),
        "requests_per_s": round(soak.requests / soak.seconds, 1),
        **held,
        "rss_before_mb": round(rss_before, 1),
        "rss_after_mb": round(rss_after, 1),
        "rss_delta_mb": round(rss_after - rss_before, 1),
        "warmup_errors": len(warm.errors),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>22}: {value}")
        for error in (warm.errors + soak.errors)[:10]:
            print("error:", error[:500])
    return 0 if not soak.errors and not warm.errors and not any(held.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
