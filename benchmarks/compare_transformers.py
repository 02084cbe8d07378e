"""tokenmill vs transformers.generate on the same model, prompts and outputs, in one process.

transformers runs static batches (left padding, greedy, no EOS) of each size in
--hf-batch-sizes, in the dtype tokenmill resolved (``dtype="auto"``: bf16 on CPUs with native
bf16); a batch generates until its longest output, and only each request's own output tokens
count. tokenmill runs the whole workload through ``LLM.generate``.
Prints output tokens/s of each and the ratio to transformers' best batch size; with
--roofline also the machine's matmul GFLOP/s and copy GB/s (probed before and after each engine
run, since shared machines drift), the compute roof of the workload at each engine's probed rate
(2 FLOPs per matmul weight per prompt or output token), each engine's fraction of it, and
tokenmill's batch-1 decode time against its bandwidth floor (matmul weight bytes / copy GB/s)
and against the weights' streaming read time: --batch1-rounds rounds, each a 64-token decode
between copy probes with a read probe after it, each round's ratios taken against its own
probes (the host's bandwidth drifts by 20-30% within minutes), medians reported.

    python benchmarks/compare_transformers.py                  # the default workload (slow)
    python benchmarks/compare_transformers.py --num-prompts 16 --hf-batch-sizes 16
    python benchmarks/compare_transformers.py --preset mixtral --num-prompts 16 --hf-batch-sizes 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from results import save  # this script's folder is on sys.path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.roofline import copy_gbps, matmul_gflops, read_gbps
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workload import PRESETS, Workload, make_random_model, make_workload


def run_transformers(path: Path, work: Workload, batch_size: int, dtype: torch.dtype) -> float:
    """Output tokens/s of static-batch greedy generation, the checkpoint's architecture in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[i : i + batch_size]
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(work.output_lens[i : i + batch_size]),
                do_sample=False,
                pad_token_id=0,
            )
    return work.n_output_tokens / (time.perf_counter() - start)


def matmul_weights(model: torch.nn.Module) -> tuple[int, int]:
    """Parameters (and bytes) a token's forward multiplies with: all but the input embedding table,
    which is only indexed (unless tied, when it is also the LM head). ~100M for the default model."""
    embed = model.model.embed_tokens.weight
    params = [p for p in model.parameters() if p is not embed or model.lm_head is None]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def batch1_decode_ms(llm: LLM, n_tokens: int = 64) -> float:
    """ms per token of one request decoding ``n_tokens`` tokens (after its first)."""
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5] * 16], params, use_tqdm=False)[0]
    return (out.metrics.finished_time - out.metrics.first_token_time) * 1000 / (n_tokens - 1)


def batch1_against_floors(llm: LLM, model_bytes: int, rounds: int) -> dict[str, float]:
    """Batch-1 decode against the copy-bandwidth floor and the streaming-read time, each round
    against the probes taken around it; medians over the rounds (after a warm-up decode)."""
    ms, copy, read, to_floor, to_read = [], [], [], [], []
    batch1_decode_ms(llm, n_tokens=8)  # warm-up
    for _ in range(rounds):
        before = copy_gbps()
        ms.append(batch1_decode_ms(llm))
        copy.append((before + copy_gbps()) / 2)
        read.append(read_gbps())
        to_floor.append(ms[-1] / (model_bytes / (copy[-1] * 1e9) * 1000))
        to_read.append(ms[-1] / (model_bytes / (read[-1] * 1e9) * 1000))
    median = statistics.median
    return {
        "batch1_rounds": rounds,
        "batch1_decode_ms": round(median(ms), 2),
        "batch1_copy_gbps": round(median(copy), 1),
        "batch1_bandwidth_floor_ms": round(model_bytes / (median(copy) * 1e9) * 1000, 2),
        "batch1_ratio_to_floor": round(median(to_floor), 3),
        "batch1_ratios_to_floor": [round(r, 2) for r in to_floor],
        "batch1_read_gbps": round(median(read), 1),
        "batch1_ratio_to_read_floor": round(median(to_read), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the preset's model)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama", help="random model without --model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--roofline", action="store_true")
    parser.add_argument("--batch1-rounds", type=int, default=5, help="batch-1 rounds with --roofline")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args()

    path = args.model or make_random_model(preset=args.preset)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = make_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), vocab)
    # The machine's speed drifts (shared hosts): with --roofline it is probed before and after every
    # engine run, and each engine's roof uses the mean of the probes around its own run.
    probe = (lambda: (matmul_gflops(), copy_gbps())) if args.roofline else (lambda: (0.0, 0.0))
    probes = [probe()]
    llm = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_running_requests=args.max_running_requests,
    )
    try:
        ours, _ = run_throughput(llm, work)
        dtype = llm.engine.dtype
        probes.append(probe())
        n_params, model_bytes = matmul_weights(llm.engine.model)
        batch1 = batch1_against_floors(llm, model_bytes, args.batch1_rounds) if args.roofline else {}
        probes.append(probe())  # transformers' first batch starts from here
    finally:
        llm.shutdown()
    hf, hf_probes = {}, {}
    for batch in args.hf_batch_sizes:
        hf[batch] = run_transformers(path, work, batch, dtype)
        probes.append(probe())
        hf_probes[batch] = (probes[-2], probes[-1])
    best = max(hf, key=hf.get)
    result = {
        "workload": work.meta | {"prompt_tokens": work.n_prompt_tokens, "output_tokens": work.n_output_tokens},
        "tokenmill_output_tok_s": round(ours.output_tok_per_s, 2),
        "tokenmill_engine_overhead": round(ours.engine_overhead, 4),
        "transformers_output_tok_s": {b: round(v, 2) for b, v in hf.items()},
        "ratio_vs_best_transformers": round(ours.output_tok_per_s / hf[best], 3),
        "transformers_best_batch": best,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if args.roofline:
        flops = 2 * n_params * (work.n_prompt_tokens + work.n_output_tokens)

        def roof_tok_s(around: tuple[tuple[float, float], ...]) -> float:
            gflops = sum(g for g, _ in around) / len(around)
            return work.n_output_tokens / (flops / (gflops * 1e9))

        ours_roof, hf_roof = roof_tok_s(tuple(probes[:2])), roof_tok_s(hf_probes[best])
        result["roofline"] = {
            "probes_matmul_gflops_copy_gbps": [[round(g, 1), round(c, 1)] for g, c in probes],
            "matmul_params": n_params,
            "tokenmill_compute_roof_output_tok_s": round(ours_roof, 1),
            "tokenmill_fraction_of_roof": round(ours.output_tok_per_s / ours_roof, 3),
            "transformers_compute_roof_output_tok_s": round(hf_roof, 1),
            "transformers_fraction_of_roof": round(hf[best] / hf_roof, 3),
        } | batch1
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    save("compare_transformers", result)


if __name__ == "__main__":
    main()
