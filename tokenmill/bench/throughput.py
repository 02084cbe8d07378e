"""``tokenmill bench throughput``: the offline workload through the ``LLM`` API.

Reports requests/s, input and output tokens/s, TTFT and time per output token (mean/p50/p99),
peak KV usage, and engine overhead (step wall time not spent in the model forward).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.stats import summarize
from tokenmill.bench.workload import PRESETS, WORKLOAD_HELP, Workload, make_random_model, make_workload
from tokenmill.config import KV_DTYPES
from tokenmill.llm import LLM
from tokenmill.request import RequestOutput, SamplingParams


@dataclass
class ThroughputResult:
    elapsed_s: float
    requests_per_s: float
    input_tok_per_s: float
    output_tok_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    peak_kv_usage: float
    engine_overhead: float  # fraction of step wall time outside the model forward
    preemptions: int
    n_requests: int
    prompt_tokens: int
    output_tokens: int
    dtype: str  # what the engine runs (dtype "auto" resolved for this machine)
    attention_backend: str
    quantization: str  # the weights' scheme, or "none"
    kv_cache_dtype: str
    weight_bytes: int  # resident bytes of the model's weights (quantized ones at their packed size)
    spec_proposed_tokens: int = 0  # speculative decoding (0 when off): tokens proposed in the run
    spec_accepted_tokens: int = 0  # of which emitted


def _watch_kv(llm: LLM, stop: threading.Event, peak: list[float]) -> None:
    while not stop.wait(0.25):
        peak[0] = max(peak[0], llm.engine.stats()["kv_usage"])


def run_throughput(llm: LLM, work: Workload) -> tuple[ThroughputResult, list[RequestOutput]]:
    """Run ``work`` (after a short warm-up) and measure it."""
    llm.generate(work.prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    before = llm.engine.stats()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    stop, peak = threading.Event(), [0.0]
    watcher = threading.Thread(target=_watch_kv, args=(llm, stop, peak), daemon=True)
    watcher.start()
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stop.set()
    watcher.join()
    after = llm.engine.stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outputs
        if len(o.outputs[0].token_ids) > 1
    ]
    step_time = after["step_time_s"] - before["step_time_s"]
    forward_time = after["forward_time_s"] - before["forward_time_s"]
    result = ThroughputResult(
        elapsed_s=elapsed,
        requests_per_s=len(outputs) / elapsed,
        input_tok_per_s=work.n_prompt_tokens / elapsed,
        output_tok_per_s=work.n_output_tokens / elapsed,
        ttft_ms=summarize(ttft, 1000),
        tpot_ms=summarize(tpot, 1000),
        peak_kv_usage=peak[0],
        engine_overhead=(step_time - forward_time) / step_time if step_time else 0.0,
        preemptions=after["scheduler"]["preemptions"] - before["scheduler"]["preemptions"],
        n_requests=len(outputs),
        prompt_tokens=work.n_prompt_tokens,
        output_tokens=work.n_output_tokens,
        dtype=str(llm.engine.dtype).removeprefix("torch."),
        attention_backend=llm.engine.model.backend.name,
        quantization=llm.engine.model.quantization.name if llm.engine.model.quantization else "none",
        kv_cache_dtype=str(llm.engine.worker.storage.k_buffer.dtype).removeprefix("torch."),
        weight_bytes=llm.engine.model.weight_bytes(),
        **_speculation(before, after),
    )
    return result, outputs


def _speculation(before: dict, after: dict) -> dict[str, int]:
    """The run's proposed and accepted tokens (none without speculative decoding)."""
    if after["speculative"] is None:
        return {}
    return {
        f"spec_{key}": after["speculative"][key] - before["speculative"][key]
        for key in ("proposed_tokens", "accepted_tokens")
    }


def plot(outputs: list[RequestOutput], result: ThroughputResult, path: Path) -> None:
    """Per-request TTFT and time per output token, as a picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ttft = [(o.metrics.first_token_time - o.metrics.arrival_time) * 1000 for o in outputs]
    prompt_lens = [len(o.prompt_token_ids) for o in outputs]
    left.scatter(prompt_lens, ttft, s=12)
    left.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="time to first token")
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) * 1000 / max(1, len(o.outputs[0].token_ids) - 1)
        for o in outputs
    ]
    right.hist(tpot, bins=30)
    right.set(xlabel="ms per output token", ylabel="requests", title="time per output token")
    fig.suptitle(f"{result.output_tok_per_s:.1f} output tok/s, {result.requests_per_s:.2f} req/s")
    fig.tight_layout()
    fig.savefig(path)


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--model",
        dest="bench_model",
        type=Path,
        default=None,
        help="checkpoint folder (default: the --preset's random model, created once)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="llama",
        help="random model when no --model: a ~100M Llama, or a Mixtral of ~100M active parameters",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default: %(default)s)")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"), help=WORKLOAD_HELP["prompt"]
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"), help=WORKLOAD_HELP["output"]
    )
    parser.add_argument("--seed", type=int, default=0, help=WORKLOAD_HELP["seed"])
    parser.add_argument(
        "--max-running-requests", type=int, default=64, help="the engine's option of that name (default: %(default)s)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="the engine's option of that name (default: %(default)s)",
    )
    parser.add_argument(
        "--quantization",
        choices=("int8", "int4"),
        default=None,
        help="the engine's option of that name (default: none)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", *KV_DTYPES),
        default="auto",
        help="the engine's option of that name (default: %(default)s)",
    )
    parser.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="the engine's option of that name, a JSON object (default: off)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of per-request latencies")


def main(args: Any) -> int:
    path = args.bench_model or make_random_model(preset=args.preset)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    work = make_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed)
    llm = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        max_running_requests=args.max_running_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
    )
    try:
        result, outputs = run_throughput(llm, work)
    finally:
        llm.shutdown()
    if args.plot:
        plot(outputs, result, args.plot)
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    print(
        f"requests: {result.n_requests}, prompt tokens: {result.prompt_tokens}, output tokens: {result.output_tokens}"
        f" ({result.dtype}, KV {result.kv_cache_dtype}, attention backend {result.attention_backend}, weights"
        f" {result.quantization}"
        f" {result.weight_bytes / 2**20:.2f} MiB)"
    )
    print(
        f"elapsed {result.elapsed_s:.1f} s: {result.requests_per_s:.2f} req/s, "
        f"{result.input_tok_per_s:.1f} input tok/s, {result.output_tok_per_s:.1f} output tok/s"
    )
    for name, s in (("TTFT", result.ttft_ms), ("TPOT", result.tpot_ms)):
        print(f"{name} ms: mean {s['mean']:.1f}, p50 {s['p50']:.1f}, p99 {s['p99']:.1f}")
    print(
        f"peak KV usage {result.peak_kv_usage:.1%}, engine overhead {result.engine_overhead:.1%}, "
        f"preemptions {result.preemptions}"
    )
    if result.spec_proposed_tokens:
        rate = result.spec_accepted_tokens / result.spec_proposed_tokens
        print(
            f"speculative: {result.spec_proposed_tokens} tokens proposed, {result.spec_accepted_tokens} accepted "
            f"({rate:.1%})"
        )
    return 0
