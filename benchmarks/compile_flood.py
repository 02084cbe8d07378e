"""A live ``tokenmill serve`` while grammar compiles that outlive their timeout fill its compile slots.

Starts ``tokenmill serve`` (the tiny model unless ``--model``: its small word-level vocabulary makes
xgrammar's compile of an object with many optional properties take tens of seconds), measures a
plain 8-token completion's latency quiet, then sends ``--slow`` concurrent requests whose JSON
schema has ``--properties`` optional properties, and while they run: the 8-token latency again,
``/health``, and then one more structured request with a small schema (the compile slots must be
free again once the slow ones are refused). Prints each phase's numbers as JSON.

    python benchmarks/compile_flood.py [--model PATH] [--slow 2] [--properties 1250]

Issue target (reliability round 3): the 8-token request within 2x its quiet latency, ``/health``
under 100 ms, slow specs a 400 at the compile timeout, and the small structured request served.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import httpx
from results import save  # this script's folder is on sys.path

PORT = 8766


def main() -> None:
    from tokenmill.default_model import TINY_MODEL_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(TINY_MODEL_DIR))
    parser.add_argument("--slow", type=int, default=2)
    parser.add_argument("--properties", type=int, default=1250)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{PORT}"
    server = subprocess.Popen(
        ["tokenmill", "serve", "--model", args.model, "--port", str(PORT)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = httpx.Client(timeout=600)
    try:
        while True:
            try:
                model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
                break
            except httpx.TransportError:
                time.sleep(0.5)

        def complete(extra: dict | None = None) -> tuple[int, float, str]:
            body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            started = time.perf_counter()
            reply = httpx.post(f"{url}/v1/completions", json={**body, **(extra or {})}, timeout=600)
            message = reply.json().get("error", {}).get("message", "") if reply.status_code != 200 else ""
            return reply.status_code, round((time.perf_counter() - started) * 1000, 1), message[:100]

        def health_ms() -> float:
            started = time.perf_counter()
            client.get(f"{url}/health")
            return round((time.perf_counter() - started) * 1000, 1)

        for _ in range(3):
            complete()
        quiet = [complete()[1] for _ in range(5)]
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(args.properties)}}
        slow_replies: list[tuple[int, float, str]] = []
        threads = [
            threading.Thread(target=lambda: slow_replies.append(complete({"guided_json": schema})))
            for _ in range(args.slow)
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        during = [complete()[1] for _ in range(5)]
        health = [health_ms() for _ in range(20)]
        for thread in threads:
            thread.join()
        slow_done_s = round(time.monotonic() - started, 1)
        small = complete({"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
        after = [complete()[1] for _ in range(5)]
        result = {
            "quiet_8_token_ms_median": statistics.median(quiet),
            "during_8_token_ms_median": statistics.median(during),
            "during_over_quiet": round(statistics.median(during) / statistics.median(quiet), 2),
            "health_ms_max_during": max(health),
            "slow_replies": slow_replies,
            "slow_done_after_s": slow_done_s,
            "small_structured_reply": small,
            "after_8_token_ms_median": statistics.median(after),
        }
        print(json.dumps(result, indent=1))
        save("compile_flood", result)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
