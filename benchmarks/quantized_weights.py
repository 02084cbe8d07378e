"""Quantized weights against the same model unquantized, one engine after another in one run.

A random model of a preset's shape (default SmolLM2-135M's: 30 layers, hidden 576) runs at the
default dtype unquantized and with each ``--quantization``: batch-1 decode (a 16-token prompt, 64
output tokens; the median ms/token of ``--repeats`` runs after a warm-up), prefill (8 prompts of
512 tokens, one output token each: prompt tokens/s, median of ``--repeats``) and throughput on the
reference workload generator (``--num-prompts`` requests, greedy, ``ignore_eos``). Ratios are
against the unquantized run.

    python benchmarks/quantized_weights.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from results import save  # this script's folder is on sys.path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import PRESETS, make_random_model, make_workload

PREFILL_PROMPTS, PREFILL_LEN = 8, 512


def measure(model: str, quantization: str | None, args: argparse.Namespace) -> dict[str, float]:
    llm = LLM(model=model, quantization=quantization, skip_tokenizer_init=True)
    try:
        single = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
        llm.generate([[5] * 16], single, use_tqdm=False)  # warm-up
        per_token = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            llm.generate([[7] * 16], single, use_tqdm=False)
            per_token.append((time.perf_counter() - started) / 64 * 1e3)
        vocab = llm.engine.worker.model.config.vocab_size
        first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        prefill = []
        for repeat in range(args.repeats):  # fresh prompts each time: no prefix-cache hits
            generator = torch.Generator().manual_seed(repeat)
            prompts = torch.randint(1, vocab, (PREFILL_PROMPTS, PREFILL_LEN), generator=generator).tolist()
            started = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            prefill.append(PREFILL_PROMPTS * PREFILL_LEN / (time.perf_counter() - started))
        workload = make_workload(args.num_prompts, (64, 511), (128, 128), vocab_size=vocab)
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in workload.output_lens]
        started = time.perf_counter()
        llm.generate(workload.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        llm.shutdown()
    return {
        "batch1_ms_per_token": round(statistics.median(per_token), 2),
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "output_tok_s": round(workload.n_output_tokens / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-135m-shape")
    parser.add_argument("--quantization", nargs="+", default=["int8", "int4"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    model = str(make_random_model(preset=args.preset))
    results = {"unquantized": measure(model, None, args)}
    for quantization in args.quantization:
        results[quantization] = measure(model, quantization, args)
    base = results["unquantized"]
    summary = {
        "results": results,
        "ratios": {
            name: {
                "batch1_time": round(r["batch1_ms_per_token"] / base["batch1_ms_per_token"], 3),
                "prefill": round(r["prefill_tok_s"] / base["prefill_tok_s"], 3),
                "throughput": round(r["output_tok_s"] / base["output_tok_s"], 3),
            }
            for name, r in results.items()
            if name != "unquantized"
        },
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    save("quantized_weights", summary)


if __name__ == "__main__":
    main()
