"""Tensor parallelism on one machine: the same workload at tp=1 and at tp=2, in one run.

tp=1 runs in this process with every CPU's torch thread; tp=2 splits the CPUs between its two ranks
(rank 0 here, one spawned worker), one rank per half, as ``tensor_parallel_size=2`` does by itself.
The runs go tp=1, tp=2, tp=2, tp=1, each on a fresh engine; the combined rates add up each size's two.
The workload and model are ``tokenmill bench throughput``'s (random prompts, the ~100M-parameter
random Llama or the Mixtral preset), greedy with ``ignore_eos``. Reported for each: output and
total tokens per second and engine steps; for tp=2 also rank 0's time inside the collectives of
the forward (the row-parallel and embedding all-reduces, the LM head's all-gather), timed around
``TensorParallel.all_reduce`` / ``all_gather_columns`` in this process: per step, per call, and as
a share of the step time. That time includes waiting for the slower rank, not only moving data.

    python benchmarks/tensor_parallel.py                     # 64 requests, as tokenmill bench throughput
    python benchmarks/tensor_parallel.py --num-prompts 16 --json tp.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from results import save  # this script's folder is on sys.path

from tokenmill import LLM
from tokenmill.bench.stats import Timer
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workload import PRESETS, Workload, make_random_model, make_workload
from tokenmill.model.parallel import TensorParallel

ORDER = (1, 2, 2, 1)
"""tensor_parallel_size of the runs, in order: a shared host's drift cancels out of the combined rates."""


def measure(model: Path, work: Workload, tensor_parallel_size: int, collectives: Timer) -> dict[str, Any]:
    """Throughput of ``work`` on a fresh engine, with its steps and rank 0's collective time."""
    llm = LLM(model=str(model), tensor_parallel_size=tensor_parallel_size, skip_tokenizer_init=True)
    try:
        before = llm.engine.stats()
        collectives.seconds.clear()
        result, _ = run_throughput(llm, work)
        after = llm.engine.stats()
    finally:
        llm.shutdown()
    steps = after["scheduler"]["steps"] - before["scheduler"]["steps"]
    step_time = after["step_time_s"] - before["step_time_s"]
    in_collectives = sum(collectives.seconds)
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "output_tok_per_s": result.output_tok_per_s,
        "total_tok_per_s": result.input_tok_per_s + result.output_tok_per_s,
        "elapsed_s": result.elapsed_s,
        "steps": steps,
        "collective_calls_per_step": len(collectives.seconds) / steps,
        "collective_ms_per_step": 1000 * in_collectives / steps,
        "collective_us_per_call": 1e6 * in_collectives / max(1, len(collectives.seconds)),
        "collective_share_of_step_time": in_collectives / step_time if step_time else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()

    model = make_random_model(preset=args.preset)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    work = make_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed)
    collectives = Timer()  # rank 0's collectives (the worker's run in its own process)
    TensorParallel.all_reduce = collectives.wrap(TensorParallel.all_reduce)
    TensorParallel.all_gather_columns = collectives.wrap(TensorParallel.all_gather_columns)
    load_before = os.getloadavg()[0]
    runs = [measure(model, work, size, collectives) for size in ORDER]
    combined = {
        size: work.n_output_tokens
        * ORDER.count(size)
        / sum(r["elapsed_s"] for r in runs if r["tensor_parallel_size"] == size)
        for size in (1, 2)
    }
    report = {
        "cpus": os.cpu_count(),
        "torch_threads_tp1": torch.get_num_threads(),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "workload": {**work.meta, "prompt_tokens": work.n_prompt_tokens, "output_tokens": work.n_output_tokens},
        "preset": args.preset,
        "runs": runs,
        "output_tok_per_s": {f"tp{size}": value for size, value in combined.items()},
        "tp2_over_tp1_output_tok_per_s": combined[2] / combined[1],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    save("tensor_parallel", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
