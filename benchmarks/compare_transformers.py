"""tokenmill vs transformers.generate on the same model, prompts and outputs, in one process.

transformers runs static batches (left padding, greedy, no EOS) of each size in
--hf-batch-sizes; a batch generates until its longest output, and only each request's own
output tokens count. tokenmill runs the whole workload through ``LLM.generate``.
Prints output tokens/s of each and the ratio to transformers' best batch size.

    python benchmarks/compare_transformers.py                  # the default workload (slow)
    python benchmarks/compare_transformers.py --num-prompts 16 --hf-batch-sizes 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import Workload, make_random_llama, make_workload


def run_transformers(path: Path, work: Workload, batch_size: int) -> float:
    """Output tokens/s of static-batch greedy generation."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[i : i + batch_size]
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(work.output_lens[i : i + batch_size]),
                           do_sample=False, pad_token_id=0)
    return work.n_output_tokens / (time.perf_counter() - start)


def run_tokenmill(path: Path, work: Workload, **engine_options) -> tuple[float, dict]:
    llm = LLM(model=str(path), skip_tokenizer_init=True, **engine_options)
    try:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate(work.prompts[:2], warm, use_tqdm=False)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
        start = time.perf_counter()
        outs = llm.generate(work.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outs] == work.output_lens
        return work.n_output_tokens / elapsed, llm.engine.stats()
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: random ~100M llama)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args()

    path = args.model or make_random_llama(Path(tempfile.gettempdir()) / "tokenmill-bench-llama")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = make_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), vocab)
    ours, stats = run_tokenmill(path, work, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_running_requests=args.max_running_requests)
    hf = {b: run_transformers(path, work, b) for b in args.hf_batch_sizes}
    best = max(hf, key=hf.get)
    result = {
        "workload": work.meta | {"prompt_tokens": work.n_prompt_tokens, "output_tokens": work.n_output_tokens},
        "tokenmill_output_tok_s": round(ours, 2),
        "transformers_output_tok_s": {b: round(v, 2) for b, v in hf.items()},
        "ratio_vs_best_transformers": round(ours / hf[best], 3),
        "transformers_best_batch": best,
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"workload: {work.meta}, {work.n_prompt_tokens} prompt + {work.n_output_tokens} output tokens")
    print(f"tokenmill:    {ours:8.2f} output tok/s  (preemptions {stats['scheduler']['preemptions']})")
    for b, v in hf.items():
        print(f"transformers: {v:8.2f} output tok/s  (static batch {b})")
    print(f"ratio tokenmill / transformers(best, batch {best}): {ours / hf[best]:.2f}x")


if __name__ == "__main__":
    main()
