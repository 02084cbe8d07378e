"""The cost of structured output: the reference workload with a JSON schema on every request vs
without, in one run on one engine.

The model is the reference random Llama (``tokenmill bench throughput``'s default preset) given
the tiny model's tokenizer (8192 tokens; the model's other ids are never allowed by a
grammar), and the prompts are the reference workload's, drawn from those 8192 ids. Both runs are
greedy with ``ignore_eos``; under the schema a reply ends when its JSON is complete, so the runs
compare output tokens per second, not elapsed time. Per-step grammar time is measured around the
engine's own calls: the masks applied to a step's logits (``apply_grammar_masks``, once per step)
and the matchers advanced by its tokens (``SequenceGrammar.advance``, which also fills the next
bitmask). After a warm-up run, the runs go plain, schema, schema, plain (so a shared host's
drift cancels; no prefix caching, so each computes every prompt) and the report adds up each
kind's two runs. The mask application alone is also timed beside xgrammar's own kernel on the same
tensors. Other processes on a shared host slow the wall clock far more than this
process's CPU time, so the report also gives output tokens per CPU second of this process.

    python benchmarks/structured_output.py                  # 64 requests, as tokenmill bench throughput
    python benchmarks/structured_output.py --num-prompts 16
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import xgrammar as xgr
from results import save  # this script's folder is on sys.path

import tokenmill.engine.grammar as grammar
import tokenmill.engine.sampler as sampler
from tokenmill import LLM, SamplingParams
from tokenmill.bench.stats import Timer
from tokenmill.bench.workload import make_random_model, make_workload
from tokenmill.default_model import TINY_MODEL_DIR
from tokenmill.request import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "admin", "tags"],
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_with_tokenizer(folder: Path) -> Path:
    """The reference random model's files plus the default model's tokenizer, in ``folder``."""
    model = make_random_model()
    for file in model.iterdir():
        (folder / file.name).symlink_to(file)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_MODEL_DIR / name, folder / name)
    return folder


def mask_kernels_ms(rows: int, vocab: int, repeats: int = 50) -> dict[str, float]:
    """Median ms to mask ``rows`` x ``vocab`` fp32 logits with random bitmasks: tokenmill's
    ``apply_grammar_masks`` beside xgrammar's own kernel, on the same tensors."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator)
    words = (vocab + 31) // 32
    bitmasks = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    masked = [SimpleNamespace(bitmask=bitmasks[i : i + 1]) for i in range(rows)]
    kernels = {
        "tokenmill": lambda: grammar.apply_grammar_masks(logits, list(range(rows)), masked),
        "xgrammar": lambda: xgr.apply_token_bitmask_inplace(logits, bitmasks),
    }
    medians = {}
    for name, kernel in kernels.items():
        kernel()  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            kernel()
            seconds.append(time.perf_counter() - start)
        medians[name] = 1000 * statistics.median(seconds)
    return medians


def run(llm: LLM, prompts: list[list[int]], output_lens: list[int], spec: StructuredOutputsParams | None) -> dict:
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, structured_outputs=spec) for n in output_lens
    ]
    before = llm.engine.stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "cpu_s": cpu,
        "output_tok_per_s": tokens / elapsed,
        "output_tok_per_cpu_s": tokens / cpu,
        "steps": after["scheduler"]["steps"] - before["scheduler"]["steps"],
        "finished_by_grammar": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        "valid_json": sum(_is_json(o.outputs[0].text) for o in outputs),
    }


def _total(runs: list[dict]) -> dict:
    """The runs' counts added up, and their joint output tokens per second."""
    total = {key: sum(r[key] for r in runs) for key in runs[0] if not key.startswith("output_tok_per")}
    total["output_tok_per_s"] = total["output_tokens"] / total["elapsed_s"]
    total["output_tok_per_cpu_s"] = total["output_tokens"] / total["cpu_s"]
    return total


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=64)
    args = parser.parse_args()

    work = make_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), 8192, args.seed)
    apply_timer, advance_timer = Timer(), Timer()
    sampler.apply_grammar_masks = apply_timer.wrap(sampler.apply_grammar_masks)
    grammar.SequenceGrammar.advance = advance_timer.wrap(grammar.SequenceGrammar.advance)
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(
            model=str(model_with_tokenizer(Path(folder))),
            max_running_requests=args.max_running_requests,
            enable_prefix_caching=False,  # every run computes every prompt
        )
        try:
            spec = StructuredOutputsParams(json=SCHEMA)
            run(llm, work.prompts[:2], [4, 4], spec)  # the grammar compiled once
            run(llm, work.prompts, work.output_lens, None)  # warm-up: every shape of the workload seen once
            apply_timer.seconds.clear()
            advance_timer.seconds.clear()
            runs: dict[str, list[dict]] = {"plain": [], "json_schema": []}
            for name in ("plain", "json_schema", "json_schema", "plain"):  # ABBA: drift of a shared host cancels
                runs[name].append(run(llm, work.prompts, work.output_lens, spec if name == "json_schema" else None))
            plain, constrained = (_total(runs[name]) for name in ("plain", "json_schema"))
            dtype = str(llm.engine.dtype).removeprefix("torch.")
            vocab_size = llm.engine.model_config.vocab_size
        finally:
            llm.shutdown()
    kernels = mask_kernels_ms(args.max_running_requests, vocab_size)
    report = {
        "dtype": dtype,
        "plain": plain,
        "json_schema": constrained,
        "throughput_ratio": constrained["output_tok_per_s"] / plain["output_tok_per_s"],
        "throughput_ratio_per_cpu_s": constrained["output_tok_per_cpu_s"] / plain["output_tok_per_cpu_s"],
        "mask_apply_ms_per_step_median": 1000 * statistics.median(apply_timer.seconds),
        "mask_kernel_ms_median": kernels,
        "mask_kernel_speedup_over_xgrammar": kernels["xgrammar"] / kernels["tokenmill"],
        "matcher_advance_us_per_token_median": 1e6 * statistics.median(advance_timer.seconds),
        "grammar_ms_per_step_mean": 1000
        * (sum(apply_timer.seconds) + sum(advance_timer.seconds))
        / max(1, constrained["steps"]),
        "step_ms_mean_with_schema": 1000 * constrained["elapsed_s"] / max(1, constrained["steps"]),
        "output_tok_per_s_each_run": {name: [round(r["output_tok_per_s"], 1) for r in rs] for name, rs in runs.items()},
        "output_tok_per_cpu_s_each_run": {
            name: [round(r["output_tok_per_cpu_s"], 1) for r in rs] for name, rs in runs.items()
        },
    }
    print(json.dumps(report, indent=2))
    save("structured_output", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
