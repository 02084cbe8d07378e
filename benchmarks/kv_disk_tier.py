"""The KV cache's disk and host tiers against recomputing, on the default model (or ``--model``).

Two parts, each engine in a fresh process, one after another, 2 threads:

* ``restart``: a 2,000-token prompt's time to first token in a fresh engine without the tier
  (recomputed; it also fills the tier), then in a fresh engine reading the tier the first one left
  (a restart), with its files in the page cache and then evicted from it (``posix_fadvise``
  DONTNEED: read from the disk itself). Each process first runs a short warm-up prompt. Reports
  TTFTs, their ratios and the tier's measured read speed.
* ``cycle``: 32 system prompts (``--prompts``) of 1,500 tokens, each request one of them plus a
  16-token question (three requests a prompt cycling through them, 16 output tokens each, all
  submitted at once) on a KV pool of 512 slots a prompt (16,384 for 32), a third of the prefixes:
  the device's prefix cache evicts each prompt before it comes back. Output tokens/s without a
  tier, with the disk tier and with a 2 GiB host tier (each tier starts empty).

    python benchmarks/kv_disk_tier.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fresh_process import answer, call
from results import save  # this script's folder is on sys.path

THREADS = 2


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def drop_page_cache(folder: str) -> None:
    """Evict the tier's files from the page cache, so the next read comes from the disk."""
    for path in Path(folder).glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine(spec: dict[str, Any], **options: Any) -> Any:
    from tokenmill import LLM

    tier = {"kv_cache_disk_dir": spec["tier"]} if spec.get("tier") else {}
    host = {"kv_cache_host_bytes": spec["host_bytes"]} if spec.get("host_bytes") else {}
    return LLM(model=spec["model"], cpu_threads=THREADS, **tier, **host, **options)


def ttft_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import SamplingParams

    llm = engine(spec)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([spec["warmup"]], [one], use_tqdm=False)
    if spec.get("drop_page_cache"):
        drop_page_cache(spec["tier"])
    start = time.perf_counter()
    (output,) = llm.generate([spec["prompt"]], [one], use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    llm.shutdown()
    return {"ttft_s": elapsed, "cached_tokens": output.num_cached_tokens, "disk_tier": stats["disk_tier"]}


def cycle_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import SamplingParams

    llm = engine(spec, num_kv_slots=spec["num_kv_slots"])
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate([spec["warmup"]], [params], use_tqdm=False)
    requests = spec["requests"]
    start = time.perf_counter()
    outputs = llm.generate(requests, [params] * len(requests), use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    llm.shutdown()
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "cached_tokens": sum(o.num_cached_tokens for o in outputs),
        "disk_tier": stats["disk_tier"],
        "host_tier": stats["host_tier"],
    }


def restart_part(model: str, work: Path) -> dict[str, Any]:
    rng = random.Random(0)
    spec = {"model": model, "prompt": token_ids(rng, 2000), "warmup": token_ids(rng, 32), "tier": str(work / "restart")}
    computed = call(__file__, sys.executable, "ttft", spec)
    warm = call(__file__, sys.executable, "ttft", spec)
    cold = call(__file__, sys.executable, "ttft", {**spec, "drop_page_cache": True})
    read = cold["disk_tier"]
    return {
        "prompt_tokens": 2000,
        "ttft_recomputed_s": computed["ttft_s"],
        "ttft_from_disk_page_cached_s": warm["ttft_s"],
        "ttft_from_disk_cold_s": cold["ttft_s"],
        "ratio_page_cached": warm["ttft_s"] / computed["ttft_s"],
        "ratio_cold": cold["ttft_s"] / computed["ttft_s"],
        "tokens_from_disk": cold["cached_tokens"],
        "disk_read_mb_per_s_cold": read["read_bytes"] / read["read_seconds"] / 1e6 if read["read_seconds"] else None,
        "block_bytes_per_token": read["read_bytes"] / max(cold["cached_tokens"], 1),
    }


def cycle_part(model: str, work: Path, n_prompts: int) -> dict[str, Any]:
    rng = random.Random(1)
    prompts = [token_ids(rng, 1500) for _ in range(n_prompts)]
    requests = [prompts[i % n_prompts] + token_ids(rng, 16) for i in range(3 * n_prompts)]
    spec = {"model": model, "requests": requests, "warmup": token_ids(rng, 32), "max_tokens": 16}
    spec["num_kv_slots"] = 512 * n_prompts  # a third of the prefixes
    without = call(__file__, sys.executable, "cycle", spec)
    with_tier = call(__file__, sys.executable, "cycle", {**spec, "tier": str(work / "cycle")})
    with_host = call(__file__, sys.executable, "cycle", {**spec, "host_bytes": 2 * 1024**3})
    runs = (("off", without), ("on", with_tier), ("host", with_host))
    rate = {name: run["output_tokens"] / run["elapsed_s"] for name, run in runs}
    return {
        "requests": len(requests),
        "output_tok_s_without_tier": rate["off"],
        "output_tok_s_with_tier": rate["on"],
        "ratio": rate["on"] / rate["off"],
        "output_tok_s_with_host_tier": rate["host"],
        "ratio_host": rate["host"] / rate["off"],
        "cached_tokens_without_tier": without["cached_tokens"],
        "cached_tokens_with_tier": with_tier["cached_tokens"],
        "cached_tokens_with_host_tier": with_host["cached_tokens"],
        "disk_hit_tokens": with_tier["disk_tier"]["hit_tokens"],
        "disk_tier_bytes": with_tier["disk_tier"]["bytes"],
        "host_hit_tokens": with_host["host_tier"]["hit_tokens"],
        "host_tier_bytes": with_host["host_tier"]["bytes"],
    }


def main(args: argparse.Namespace) -> None:
    from tokenmill.default_model import default_model

    model = args.model or str(default_model())
    with tempfile.TemporaryDirectory(dir=args.work_dir) as folder:
        work = Path(folder)
        result: dict[str, Any] = {"model": model}
        if "restart" in args.parts:
            result["restart"] = restart_part(model, work)
        if "cycle" in args.parts:
            result["cycle"] = cycle_part(model, work, args.prompts)
    print(json.dumps(result, indent=None if args.json else 1))
    save("kv_disk_tier", result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--parts", nargs="+", default=["restart", "cycle"], choices=["restart", "cycle"])
    parser.add_argument("--work-dir", default=None, help="where the tiers' folders go (default: the temp dir)")
    parser.add_argument("--prompts", type=int, default=32, help="system prompts of the cycle part (3 requests each)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    if ARGS.worker:
        answer(ARGS.worker, {"ttft": ttft_task, "cycle": cycle_task})
    else:
        main(ARGS)
