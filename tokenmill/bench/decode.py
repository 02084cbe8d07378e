"""``tokenmill bench decode``: batch-1 decode over fresh processes, its spread, and its share of the
machine's memory bandwidth.

Each of ``--starts`` fresh processes loads the model (``LLM(model=...)``), generates once to warm up,
then times ``--repeats`` greedy generations of ``--tokens`` tokens after a ``--context``-token prompt:
ms per token = (time of ``tokens + 1`` tokens - time of the first) / ``tokens``, the process's
median. Reported: each start's figure and ready time (``LLM(...)`` to its first token), the median,
the spread (slowest / fastest start), the streaming read rate of the machine measured in a fresh
process of its own before the starts (``roofline.read_gbps``), and the fraction of it batch-1
decode reaches: the bytes one decode step reads (every weight but an embedding table that is only
indexed) per ms per token, over that rate.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

from tokenmill.bench.roofline import read_gbps
from tokenmill.llm import LLM
from tokenmill.request import SamplingParams


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", dest="bench_model", default=None, help="model (default: the default model)")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (default: %(default)s)")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"], help="quantize at load")
    parser.add_argument("--starts", type=int, default=5, help="fresh processes (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before decoding (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens timed per generation (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per start (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="the engine's cpu_threads (default: its own)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def decode_bytes(llm: LLM) -> int:
    """Bytes one decode step reads from ``llm``'s weights: all of them but an embedding table that
    is only indexed (one the LM head does not read)."""
    model = llm.engine.worker.model
    total = model.weight_bytes()
    if model.lm_head is not None:
        table = model.model.embed_tokens.weight
        total -= table.numel() * table.element_size()
    return total


def one_start(spec: dict[str, Any]) -> dict[str, Any]:
    """One process's figures (see the module docstring)."""
    started = time.perf_counter()
    options = {k: spec[k] for k in ("dtype", "quantization") if spec[k] is not None}
    if spec["threads"] is not None:
        options["cpu_threads"] = spec["threads"]
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, **options)
    try:
        first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate([[5, 6, 7]], first, use_tqdm=False)
        ready = time.perf_counter() - started
        vocab = llm.engine.model_config.vocab_size
        prompt = [(7 + 31 * i) % vocab for i in range(spec["context"])]

        def run(tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            return time.perf_counter() - t

        run(spec["tokens"] + 1)  # warm-up
        times = [(run(spec["tokens"] + 1) - run(1)) / spec["tokens"] for _ in range(spec["repeats"])]
        return {"decode_ms_per_token": 1000 * statistics.median(times), "ready_s": ready, "bytes": decode_bytes(llm)}
    finally:
        llm.shutdown()


def _fresh(task: str, spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill.bench.decode", task, json.dumps(spec)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"a fresh {task} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(args: Any) -> int:
    spec = {
        "model": args.bench_model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "context": args.context,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    gbps = _fresh("roof", {})["read_gbps"]
    starts = [_fresh("start", spec) for _ in range(args.starts)]
    ms = [s["decode_ms_per_token"] for s in starts]
    median = statistics.median(ms)
    result = {
        "decode_ms_per_token": {"median": median, "starts": ms, "spread": max(ms) / min(ms)},
        "ready_s": [s["ready_s"] for s in starts],
        "decode_bytes": starts[0]["bytes"],
        "read_gbps": gbps,
        "roof_fraction": starts[0]["bytes"] / (median / 1000) / (gbps * 1e9),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"batch-1 decode at {args.context} tokens of context, {args.starts} fresh processes:")
        print(f"  ms/token: median {median:.2f}, starts {', '.join(f'{m:.2f}' for m in ms)}")
        print(f"  spread (slowest / fastest start): {result['decode_ms_per_token']['spread']:.3f}")
        print(f"  ready (LLM() to the first token): {', '.join(f'{s:.1f}' for s in result['ready_s'])} s")
        print(f"  read rate {gbps:.1f} GB/s; {result['decode_bytes'] / 2**20:.0f} MiB a step: "
              f"{100 * result['roof_fraction']:.0f}% of the roof")  # fmt: skip
    return 0


if __name__ == "__main__":  # a fresh process of main()
    task, given = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"read_gbps": read_gbps()} if task == "roof" else one_start(given)))
