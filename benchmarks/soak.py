"""Soak: random valid requests through a live server, then a check that nothing leaked.

Requests go to ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/messages`` over loopback
at bounded concurrency (asyncio + httpx), with random parameters: streaming or not, ``n`` in
1..3, stop strings, ``max_tokens`` 1..16, temperature / top_p / seed, sometimes logprobs and
penalties, and clients that leave mid-stream (or before a non-streamed answer). Every answer
is checked: complete and well-formed (a finish reason for each choice) or a clean error status.

Beside the measured batch, attack clients run (``--attackers`` of each kind): slow-body clients
(headers, then a body byte at a time, never finished: the server must answer 408), idle
connections (nothing sent: the server must close them) and oversized stop lists (the server
must refuse them with a clean 4xx). Each attack connection is followed until the server ends it.
The report gives the well-behaved clients' p99 latency beside the attack and the connections
the server holds at the peak and afterwards.

Afterwards the engine must be idle with nothing held (no running or waiting request, every
request-table row free, KV pages in use == pages held by the prefix cache: 0 live KV pages), no
per-request object may survive a garbage collection, the server may hold no connection, and RSS
growth over a second batch after a warm-up must stay bounded. The engine and uvicorn run in this
process, so the RSS is the server's plus the client's.

    python benchmarks/soak.py --requests 5000 --concurrency 32          # the default model
    python benchmarks/soak.py --model path/to/checkpoint --requests 20000 --json
    python benchmarks/soak.py --attackers 8 --header-timeout-seconds 2 --body-timeout-seconds 2

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
from tokenmill.cpu_memory import release_freed_memory
from tokenmill.engine.request_state import RequestState
from tokenmill.engine.sequence import Sequence
from tokenmill.server.background import serve_in_background
from tokenmill.server.config import ServerConfig
from tokenmill.server.shared.generation import Generation

try:
    from results import save  # run as a script: its folder is on sys.path
except ImportError:  # imported as benchmarks.soak (the reliability tests)
    from benchmarks.results import save

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
    latencies: list[float] = field(default_factory=list)  # seconds, of each completed request

    def p99_latency(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


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
    started = time.monotonic()
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
        result.latencies.append(time.monotonic() - started)
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


# ------------------------------------------------------------------------------------ attack clients
ATTACKS = ("slow_body", "idle", "oversized_stop")
OVERSIZED_STOP_STRINGS = 10_000
ATTACK_BYTE_INTERVAL_S = 0.2  # a slow-body client sends one byte this often


@dataclass
class AttackResult:
    """Per kind of attack: connections or requests made, and how many the server ended as it should."""

    attempts: Counter[str] = field(default_factory=Counter)
    ended: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # the server answered wrongly, or never ended one


async def _slow_body(host: str, port: int, give_up_s: float) -> str | None:
    """One connection: headers, then a byte of the announced body at a time; None if the server answers 408."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: 1000\r\n\r\n{{".encode())
        deadline = time.monotonic() + give_up_s
        while time.monotonic() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                answer = await asyncio.wait_for(reader.read(65536), ATTACK_BYTE_INTERVAL_S)
                return None if answer.startswith(b"HTTP/1.1 408") else f"slow body answered {answer[:200]!r}"
            writer.write(b" ")
        return f"slow body held for {give_up_s} s"
    except ConnectionError:
        return None  # the server closed while a byte was on its way, after its 408
    finally:
        writer.close()


async def _idle(host: str, port: int, give_up_s: float) -> str | None:
    """One connection that sends nothing; None if the server closes it."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        answer = await asyncio.wait_for(reader.read(65536), give_up_s)
        return None if answer == b"" else f"idle connection answered {answer[:200]!r}"
    except asyncio.TimeoutError:
        return f"idle connection held for {give_up_s} s"
    finally:
        writer.close()


async def _oversized_stop(client: httpx.AsyncClient, url: str, model: str) -> str | None:
    """One request with a huge stop list; None if it is refused with a clean 4xx."""
    body = {
        "model": model,
        "prompt": "hello",
        "max_tokens": 4,
        "stop": [f"s{i}" for i in range(OVERSIZED_STOP_STRINGS)],
    }
    response = await client.post(url + "/v1/completions", json=body)
    if 400 <= response.status_code < 500 and response.json().get("error", {}).get("message"):
        return None
    return f"oversized stop list answered {response.status_code}: {response.text[:200]}"


async def _attacker(
    kind: str, url: str, model: str, limits: ServerConfig, stop: asyncio.Event, result: AttackResult
) -> None:
    """Attack until ``stop`` is set, one connection or request at a time, each followed until the server ends it."""
    host, port = url.removeprefix("http://").split(":")
    give_up_s = max(limits.header_timeout_seconds, limits.body_timeout_seconds) + 30
    async with httpx.AsyncClient(timeout=give_up_s) as client:
        while not stop.is_set():
            result.attempts[kind] += 1
            try:
                if kind == "slow_body":
                    error = await _slow_body(host, int(port), give_up_s)
                elif kind == "idle":
                    error = await _idle(host, int(port), give_up_s)
                else:
                    error = await _oversized_stop(client, url, model)
            except (OSError, httpx.HTTPError) as exc:
                error = f"{kind}: {type(exc).__name__}: {exc}"
            if error is None:
                result.ended[kind] += 1
            else:
                result.errors.append(error)


async def run_with_attacks(
    url: str, calls: list[Call], concurrency: int, attackers: int, model: str, limits: ServerConfig
) -> tuple[SoakResult, AttackResult, int]:
    """``run_calls`` beside ``attackers`` clients of each kind in :data:`ATTACKS`.

    Returns the workload's result, the attacks' result, and the most connections the server held at once.
    """
    attacks = AttackResult()
    stop = asyncio.Event()
    port = int(url.rsplit(":", 1)[1])
    tasks = [
        asyncio.create_task(_attacker(kind, url, model, limits, stop, attacks))
        for kind in ATTACKS
        for _ in range(attackers)
    ]
    peak = 0

    async def sample_connections() -> None:
        nonlocal peak
        while True:
            peak = max(peak, server_connections(port))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample_connections())
    try:
        workload = await run_calls(url, calls, concurrency)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        sampler.cancel()
    return workload, attacks, peak


def server_connections(port: int) -> int:
    """TCP connections the server on ``port`` holds open (Linux ``/proc/net/tcp*``: established or closing)."""
    held_states = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT (the peer closed, the server has not)
    count = 0
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            count += int(local.rsplit(":", 1)[1], 16) == port and state in held_states
    return count


def wait_for_connections_closed(port: int, timeout: float = 10) -> int:
    """``server_connections(port)`` once it is 0, or after ``timeout`` (a closing connection takes a moment)."""
    deadline = time.monotonic() + timeout
    while (held := server_connections(port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


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
    """Resident set size of this process in MiB (Linux ``/proc/self/status``), of live memory: the free
    memory malloc keeps (``cpu_keep_freed_memory``) is returned first."""
    release_freed_memory()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@contextlib.contextmanager
def serving(engine: Engine, config: ServerConfig) -> Iterator[str]:
    """Serve ``engine`` as ``config`` says on a free loopback port in a background thread; yields the base URL."""
    with serve_in_background(engine, config) as port:
        yield f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the default model)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the first RSS reading")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-slots", type=int, default=8192)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--attackers", type=int, default=2, help="attack clients of each kind beside the soak")
    defaults = ServerConfig()
    parser.add_argument("--header-timeout-seconds", type=float, default=defaults.header_timeout_seconds)
    parser.add_argument("--body-timeout-seconds", type=float, default=defaults.body_timeout_seconds)
    args = parser.parse_args(argv)

    limits = ServerConfig(
        header_timeout_seconds=args.header_timeout_seconds, body_timeout_seconds=args.body_timeout_seconds
    )
    engine = Engine(model=args.model, num_kv_slots=args.num_kv_slots)
    model = engine.config.model_path().name
    try:
        with serving(engine, limits) as url:
            warm = asyncio.run(run_calls(url, make_calls(args.warmup, args.seed, model), args.concurrency))
            leaks(engine)
            rss_before = rss_mb()
            calls = make_calls(args.requests, args.seed + 1, model)
            soak, attacks, peak = asyncio.run(
                run_with_attacks(url, calls, args.concurrency, args.attackers, model, limits)
            )
            held = leaks(engine)
            connections_after = wait_for_connections_closed(int(url.rsplit(":", 1)[1]))
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
        "p99_latency_s": round(soak.p99_latency(), 3),
        **{f"attack_{kind}": f"{attacks.ended[kind]}/{attacks.attempts[kind]} ended by the server" for kind in ATTACKS},
        "attack_errors": len(attacks.errors),
        "server_connections_peak": peak,
        "server_connections_after": connections_after,
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
            print(f"{key:>25}: {value}")
        for error in (warm.errors + soak.errors + attacks.errors)[:10]:
            print("error:", error[:500])
    save("soak", report)
    clean = not soak.errors and not warm.errors and not attacks.errors and not connections_after
    return 0 if clean and not any(held.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
