"""The int8 and fp8 KV caches against the model-dtype one: decode speed and accuracy.

* ``kernel``: the C++ decode attention kernel alone, 64 requests x 360 tokens, 12 query / 4 KV
  heads of 64 (the reference Llama's), over a cache of each KV dtype (``--kv``; "auto": the
  machine's default model dtype); the median ms of ``--calls`` calls each.
* ``step``: a 64-request decode step of the reference ~100M Llama (the machine's default dtype):
  the prompts (330-362 tokens) are cached first, then the same prompts run to 9 and to 41 output
  tokens (their prefill a one-token prefix hit), alternating ``--rounds`` times; a step is the
  difference over 32 steps; the median per KV dtype, each in a fresh process.
* ``throughput``: ``tokenmill bench throughput`` (the reference workload: 64 requests at once,
  32-512 prompt and 32-256 output tokens, the random ~100M Llama, the machine's default dtype)
  with ``--kv-cache-dtype auto`` and ``int8``, each in a fresh process, alternating, ``--rounds``
  times; reports the median output tokens/s of each and their ratio.
* ``accuracy``: on the default model (or ``--model``), the perplexity of a text (this repository's
  README, ``--tokens`` tokens in windows of 1,024) from prompt logprobs with each KV dtype (``--kv``,
  and fp32), and how many of 16 greedy continuations of 64 tokens are identical to the model-dtype
  KV's (and how long each agrees), beside the same for an fp32 KV cache (how much near-ties alone
  move greedy tokens).

    python benchmarks/kv_int8.py --json
    python benchmarks/kv_int8.py --parts kernel step accuracy --kv auto bfloat16 int8 fp8_e4m3 fp8_e5m2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fresh_process import answer, call
from results import save  # this script's folder is on sys.path

README = Path(__file__).parents[1] / "README.md"


def throughput_part(rounds: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"auto": [], "int8": []}
    for _ in range(rounds):
        for kv in rates:
            command = [sys.executable, "-m", "tokenmill.cli", "bench", "throughput", "--kv-cache-dtype", kv, "--json"]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rates[kv].append(json.loads(done.stdout.strip().splitlines()[-1])["output_tok_per_s"])
    median = {kv: statistics.median(values) for kv, values in rates.items()}
    return {
        "output_tok_s": rates,
        "median_model_dtype_kv": median["auto"],
        "median_int8_kv": median["int8"],
        "ratio": median["int8"] / median["auto"],
    }


def kernel_part(kv_names: list[str], calls: int) -> dict[str, Any]:
    import torch

    from tokenmill.cache.kv_quant import LayerKV
    from tokenmill.cache.storage import KVStorage
    from tokenmill.config import EngineConfig
    from tokenmill.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build"
    config = EngineConfig(device="cpu")
    model_dtype = config.resolved_dtype(None)
    requests, tokens, heads, kv_heads, dim = 64, 360, 12, 4, 64
    slots = torch.randperm(requests * tokens, generator=torch.Generator().manual_seed(0)) + 1
    table = slots.view(requests, tokens).to(torch.int32)
    rows, lens = torch.arange(requests), torch.full((requests,), tokens)
    q = torch.randn(requests, heads, dim).to(model_dtype)
    caches = {}
    for name in kv_names:
        kv_dtype = EngineConfig(device="cpu", kv_cache_dtype=name).resolved_kv_dtype(model_dtype)
        storage = KVStorage(1, requests * tokens + 1, kv_heads, dim, kv_dtype, "cpu")
        caches[name] = LayerKV.of(storage, 0, kernels)  # KVStorage has the view's buffer and scale fields
        values = torch.randn(requests * tokens, kv_heads, dim).to(model_dtype)
        caches[name].store(slots, values, -values)
    times: dict[str, list[float]] = {name: [] for name in kv_names}
    for _ in range(calls + 3):  # the KV dtypes alternate: a neighbour's load falls on all alike
        for name, cache in caches.items():
            start = time.perf_counter()
            kernels.paged_decode_attention(
                q, cache.k, cache.v, table, rows, lens, dim**-0.5, 0, cache.k_scale, cache.v_scale
            )
            times[name].append(time.perf_counter() - start)
    result: dict[str, Any] = {"model_dtype": str(model_dtype).removeprefix("torch.")}
    for name, cache in caches.items():
        kv = str(cache.k.dtype).removeprefix("torch.")
        result[name] = {"kv": kv, "median_ms": 1000 * statistics.median(times[name][3:])}
    return result


def step_task(spec: dict[str, Any]) -> dict[str, Any]:
    import random

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.workload import make_random_model

    llm = LLM(model=str(make_random_model()), kv_cache_dtype=spec["kv"], skip_tokenizer_init=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 30000) for _ in range(rng.randint(330, 362))] for _ in range(64)]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # cache the prompts
    elapsed: dict[int, list[float]] = {9: [], 41: []}
    for _ in range(spec["rounds"]):
        for n in elapsed:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed[n].append(time.perf_counter() - start)
    kv_dtype = str(llm.engine.worker.storage.k_buffer.dtype).removeprefix("torch.")
    model_dtype = str(llm.engine.dtype).removeprefix("torch.")
    llm.shutdown()
    steps = [1000 * (long - short) / 32 for short, long in zip(elapsed[9], elapsed[41])]
    return {"kv": kv_dtype, "model_dtype": model_dtype, "step_ms": steps, "median_step_ms": statistics.median(steps)}


def step_part(kv_names: list[str], rounds: int) -> dict[str, Any]:
    return {kv: call(__file__, sys.executable, "step", {"kv": kv, "rounds": rounds}) for kv in kv_names}


def accuracy_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=spec["model"], kv_cache_dtype=spec["kv"], max_num_batched_tokens=256)
    tokenizer = llm.engine.tokenizer.hf
    ids = tokenizer(README.read_text())["input_ids"][: spec["tokens"]]
    windows = [ids[i : i + 1024] for i in range(0, len(ids), 1024) if len(ids[i : i + 1024]) > 1]
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    logprobs = [
        entry[token].logprob
        for output in llm.generate(windows, [scoring] * len(windows), use_tqdm=False)
        for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])
    ]
    starts = [ids[i : i + 32] for i in range(0, 16 * 97, 97)]
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in llm.generate(starts, [greedy] * len(starts), use_tqdm=False)]
    kv_dtype = str(llm.engine.worker.storage.k_buffer.dtype)
    llm.shutdown()
    perplexity = math.exp(-sum(logprobs) / len(logprobs))
    return {"perplexity": perplexity, "logprobs": logprobs, "greedy": continuations, "kv": kv_dtype}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many continuations are identical, and how many tokens each pair agrees before differing."""
    before = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    same = sum(p == q for p, q in zip(a, b))
    return {"identical": f"{same} of {len(a)}", "tokens_before_the_first_difference": before}


def accuracy_part(model: str, tokens: int, kv_names: list[str]) -> dict[str, Any]:
    spec = {"model": model, "tokens": tokens}
    runs = {
        kv: call(__file__, sys.executable, "accuracy", {**spec, "kv": kv})
        for kv in dict.fromkeys(["auto", *kv_names, "float32"])
    }
    plain, fp32 = runs["auto"], runs["float32"]
    result: dict[str, Any] = {"model_dtype_kv": plain["kv"], "tokens_scored": len(plain["logprobs"])}
    for kv, run in runs.items():
        gaps = [abs(a - b) for a, b in zip(plain["logprobs"], run["logprobs"])]
        result[kv] = {
            "kv": run["kv"],
            "perplexity": run["perplexity"],
            "perplexity_increase_vs_model_dtype_kv": run["perplexity"] / plain["perplexity"] - 1,
            "perplexity_increase_vs_float32_kv": run["perplexity"] / fp32["perplexity"] - 1,
            "text_token_logprob_abs_difference": {
                "mean": statistics.fmean(gaps),
                "p99": sorted(gaps)[int(0.99 * len(gaps))],
                "max": max(gaps),
            },
            "greedy_vs_model_dtype_kv": agreement(plain["greedy"], run["greedy"]),
        }
    return result


def main(args: argparse.Namespace) -> None:
    from tokenmill.default_model import default_model

    result: dict[str, Any] = {}
    if "kernel" in args.parts:
        result["kernel"] = kernel_part(args.kv, args.calls)
    if "step" in args.parts:
        result["step"] = step_part(args.kv, args.rounds)
    if "accuracy" in args.parts:
        result["accuracy"] = accuracy_part(args.model or str(default_model()), args.tokens, args.kv)
    if "throughput" in args.parts:
        result["throughput"] = throughput_part(args.rounds)
    print(json.dumps(result, indent=None if args.json else 1))
    save("kv_int8", result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parts = ["kernel", "step", "accuracy", "throughput"]
    parser.add_argument("--parts", nargs="+", default=["accuracy", "throughput"], choices=parts)
    parser.add_argument("--kv", nargs="+", default=["auto", "int8"], help="KV dtypes of kernel, step, accuracy")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    if ARGS.worker:
        answer(ARGS.worker, {"accuracy": accuracy_task, "step": step_task})
    else:
        main(ARGS)
