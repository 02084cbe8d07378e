"""``tokenmill bench serve``: a streaming load test of any OpenAI-compatible ``/v1/completions``.

Definitions (as in the vLLM / SGLang serving benchmarks):
  TTFT  time from sending a request to its first streamed token;
  ITL   gap between consecutive streamed chunks of one request;
  TPOT  (end-to-end latency - TTFT) / (output tokens - 1) per request;
  throughput  completed requests and output tokens per second of wall time.
Arrivals are Poisson at --request-rate requests/s (inf = all at once), at most
--max-concurrency in flight. The run is bounded by --num-prompts and --timeout.

It needs nothing tokenmill-specific: it calls only GET /v1/models (unless --model-name is given)
and POST /v1/completions (token-id prompts, streamed, greedy, stream_options.include_usage, and
vLLM's ignore_eos so outputs run to their drawn length), with --api-key as a bearer token. Output
tokens are counted from the streamed usage, or, from a server that sends none, as the text chunks.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.bench.stats import summarize
from tokenmill.bench.workload import WORKLOAD_HELP, Workload, make_workload


@dataclass
class RequestRecord:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


@dataclass
class ServeResult:
    completed: int
    failed: int
    elapsed_s: float
    requests_per_s: float
    output_tok_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: list[str]  # the failed requests' distinct errors, at most MAX_ERRORS_REPORTED


MAX_ERRORS_REPORTED = 10


async def _one(client: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    record = RequestRecord(ok=False)
    last = None
    usage_tokens, text_chunks = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):  # a failure reported mid-stream
                    record.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return record
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    text_chunks += 1
                    stamp = time.perf_counter()
                    if last is None:
                        record.ttft = stamp - start
                    else:
                        record.itl.append(stamp - last)
                    last = stamp
        record.latency = time.perf_counter() - start
        record.output_tokens = usage_tokens if usage_tokens is not None else text_chunks
        record.ok = True
    except Exception as exc:  # reported, never fatal to the benchmark
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_serve(
    url: str,
    work: Workload,
    model: str | None,
    request_rate: float,
    max_concurrency: int,
    timeout: float,
    seed: int = 0,
    api_key: str | None = None,
) -> ServeResult:
    """The workload against the server at ``url`` (without ``/v1``); ``model`` None: the first of
    ``/v1/models``; ``api_key`` is sent as a bearer token."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, headers=headers) as client:
        if model is None:
            models = await client.get(f"{url}/v1/models")
            models.raise_for_status()
            model = models.json()["data"][0]["id"]
        gate = asyncio.Semaphore(max_concurrency)

        async def limited(prompt: list[int], max_tokens: int) -> RequestRecord:
            async with gate:
                return await _one(client, url, model, prompt, max_tokens)

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in zip(work.prompts, work.output_lens):
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = await asyncio.wait_for(asyncio.gather(*tasks), timeout)
        elapsed = time.perf_counter() - start
    done = [r for r in records if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return ServeResult(
        completed=len(done),
        failed=len(records) - len(done),
        elapsed_s=elapsed,
        requests_per_s=len(done) / elapsed,
        output_tok_per_s=sum(r.output_tokens for r in done) / elapsed,
        ttft_ms=summarize([r.ttft for r in done], 1000),
        tpot_ms=summarize(tpot, 1000),
        itl_ms=summarize([gap for r in done for gap in r.itl], 1000),
        e2e_ms=summarize([r.latency for r in done], 1000),
        errors=list(dict.fromkeys(r.error for r in records if not r.ok))[:MAX_ERRORS_REPORTED],
    )


def add_arguments(parser: Any) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    parser.add_argument("--model-name", default=None, help="model name to send (default: first of /v1/models)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else none)",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default: %(default)s)")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"), help=WORKLOAD_HELP["prompt"]
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"), help=WORKLOAD_HELP["output"]
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this (default: 1000)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second; inf sends all at once (default: %(default)s)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=64, help="most requests in flight (default: %(default)s)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="bound on the whole run, seconds")
    parser.add_argument("--seed", type=int, default=0, help=WORKLOAD_HELP["seed"])
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def main(args: Any) -> int:
    work = make_workload(
        args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), args.vocab_size or 1000, args.seed
    )
    result = asyncio.run(
        run_serve(
            args.url,
            work,
            args.model_name,
            args.request_rate,
            args.max_concurrency,
            args.timeout,
            args.seed,
            args.api_key,
        )
    )
    if args.json:
        print(json.dumps(asdict(result)))
        return 0 if result.failed == 0 else 1
    print(
        f"completed {result.completed}, failed {result.failed} in {result.elapsed_s:.1f} s: "
        f"{result.requests_per_s:.2f} req/s, {result.output_tok_per_s:.1f} output tok/s"
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = getattr(result, name)
        print(f"{name[:-3].upper():5s} ms: mean {s['mean']:.1f}, p50 {s['p50']:.1f}, p99 {s['p99']:.1f}")
    for error in result.errors:
        print(f"failed: {error}")
    return 0 if result.failed == 0 else 1
