"""The int8 KV cache against the model-dtype one: decode throughput and accuracy.

* ``throughput``: ``tokenmill bench throughput`` (the reference workload: 64 requests at once,
  32-512 prompt and 32-256 output tokens, the random ~100M Llama, the machine's default dtype)
  with ``--kv-cache-dtype auto`` and ``int8``, each in a fresh process, alternating, ``--rounds``
  times; reports the median output tokens/s of each and their ratio.
* ``accuracy``: on the default model (or ``--model``), the perplexity of a text (this repository's
  README, ``--tokens`` tokens in windows of 1,024) from prompt logprobs with each KV dtype, and how
  many of 16 greedy continuations of 64 tokens are identical (and how long each agrees), beside the
  same for an fp32 KV cache (how much near-ties alone move greedy tokens).

    python benchmarks/kv_int8.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from fresh_process import answer, call

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


def accuracy_part(model: str, tokens: int) -> dict[str, Any]:
    spec = {"model": model, "tokens": tokens}
    plain = call(__file__, sys.executable, "accuracy", {**spec, "kv": "auto"})
    int8 = call(__file__, sys.executable, "accuracy", {**spec, "kv": "int8"})
    fp32 = call(__file__, sys.executable, "accuracy", {**spec, "kv": "float32"})
    gaps = [abs(a - b) for a, b in zip(plain["logprobs"], int8["logprobs"])]
    return {
        "model_dtype_kv": plain["kv"],
        "perplexity_model_dtype_kv": plain["perplexity"],
        "perplexity_int8_kv": int8["perplexity"],
        "perplexity_float32_kv": fp32["perplexity"],
        "perplexity_increase_int8": int8["perplexity"] / plain["perplexity"] - 1,
        "tokens_scored": len(plain["logprobs"]),
        "text_token_logprob_abs_difference_int8": {
            "mean": statistics.fmean(gaps),
            "p99": sorted(gaps)[int(0.99 * len(gaps))],
            "max": max(gaps),
        },
        "greedy_int8_vs_model_dtype_kv": agreement(plain["greedy"], int8["greedy"]),
        "greedy_float32_vs_model_dtype_kv": agreement(plain["greedy"], fp32["greedy"]),
    }


def main(args: argparse.Namespace) -> None:
    from tokenmill.default_model import default_model

    result: dict[str, Any] = {}
    if "accuracy" in args.parts:
        result["accuracy"] = accuracy_part(args.model or str(default_model()), args.tokens)
    if "throughput" in args.parts:
        result["throughput"] = throughput_part(args.rounds)
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--parts", nargs="+", default=["accuracy", "throughput"], choices=["accuracy", "throughput"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    if ARGS.worker:
        answer(ARGS.worker, {"accuracy": accuracy_task})
    else:
        main(ARGS)
