"""Many LoRA adapters at once: 64 requests of the reference workload spread over 8 rank-16 adapters
(every projection adapted) against the base model alone, in tokenmill and in vLLM's CPU build.

The base is the reference random Llama (~100M parameters, ``tokenmill bench``'s "llama" preset);
the adapters are random PEFT adapters (rank 16, alpha 32, q/k/v/o/gate/up/down), written once to
``--work-dir``. Request ``i`` uses adapter ``i % 8``. Each run is a fresh process, one after
another: tokenmill base, tokenmill with adapters, then (with ``--vllm-python``) vLLM's base and
adapters. Token-id prompts, greedy, ``ignore_eos``, prefix caching off; output tokens/s and the
ratios are printed (``--json``: as JSON). A third tokenmill run, the base model with its C++ decode
forward turned off, measures what a step with adapter rows gives up by running eagerly.

    python benchmarks/lora.py --json
    python benchmarks/lora.py --vllm-python V/bin/python --json   # V: see benchmarks/compare_vllm.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from fresh_process import answer, call
from results import save  # this script's folder is on sys.path

N_ADAPTERS = 8
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}


def prepare(work_dir: Path) -> dict[str, Any]:
    """The base model, the adapters and the workload (written once)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tokenmill.bench.workload import make_random_model, make_workload

    base = make_random_model(work_dir / "base")
    for i in range(N_ADAPTERS):
        folder = work_dir / f"adapter-{i}"
        if (folder / "adapter_model.safetensors").is_file():
            continue
        model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        torch.manual_seed(i)
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(folder)
    work = make_workload(64, seed=0)
    return {
        "base": str(base),
        "adapters": [str(work_dir / f"adapter-{i}") for i in range(N_ADAPTERS)],
        "prompts": work.prompts,
        "output_lens": work.output_lens,
    }


def run_tokenmill(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, LoRARequest, SamplingParams

    adapters = spec["adapters"] if spec["mode"] == "adapters" else []
    llm = LLM(
        model=spec["base"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_running_requests=64,
        enable_lora=bool(adapters),
        max_loras=N_ADAPTERS,
        max_lora_rank=RANK,
        lora_modules={f"a{i}": path for i, path in enumerate(adapters)},
    )
    if spec["mode"] == "base_eager":  # what steps with adapter rows run: the eager forward
        llm.engine.worker.cpu_decode = None
    requests = [LoRARequest(f"a{i % len(adapters)}") for i in range(len(spec["prompts"]))] if adapters else None
    elapsed, outputs = _timed(llm.generate, spec, SamplingParams, requests)
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    llm.shutdown()
    return _result(elapsed, [o.outputs[0].token_ids for o in outputs], dtype)


def run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    adapters = spec["adapters"] if spec["mode"] == "adapters" else []
    options = dict(enable_lora=True, max_loras=N_ADAPTERS, max_lora_rank=RANK) if adapters else {}
    llm = LLM(
        model=spec["base"],
        dtype=spec["dtype"],
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=1024,
        **options,
    )
    n = len(spec["prompts"])
    requests = [LoRARequest(f"a{i % 8}", i % 8 + 1, adapters[i % 8]) for i in range(n)] if adapters else None
    elapsed, outputs = _timed(llm.generate, spec, SamplingParams, requests, detokenize=False)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    return _result(elapsed, [list(o.outputs[0].token_ids) for o in outputs], dtype)


def _timed(generate: Any, spec: dict[str, Any], params_class: Any, requests: list | None, **extra: Any) -> tuple:
    """Warm up on two requests (their adapters loaded), then time the whole workload."""
    params = [params_class(max_tokens=n, temperature=0.0, ignore_eos=True, **extra) for n in spec["output_lens"]]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    warm = {"lora_request": requests[:N_ADAPTERS]} if requests else {}
    short = [params_class(max_tokens=2, temperature=0.0, ignore_eos=True, **extra)] * min(N_ADAPTERS, len(prompts))
    generate(prompts[: len(short)], short, use_tqdm=False, **warm)
    start = time.perf_counter()
    outputs = generate(prompts, params, use_tqdm=False, **({"lora_request": requests} if requests else {}))
    return time.perf_counter() - start, outputs


def _result(elapsed: float, token_ids: list[list[int]], dtype: str) -> dict[str, Any]:
    tok_s = sum(map(len, token_ids)) / elapsed
    return {"elapsed_s": round(elapsed, 2), "output_tok_s": round(tok_s, 1), "dtype": dtype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokenmill-lora-bench"))
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (see compare_vllm.py)")
    parser.add_argument("--dtype", default="auto", help="both engines' dtype (default: %(default)s)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        answer(args.worker, {"tokenmill": run_tokenmill, "vllm": run_vllm})
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    spec = prepare(args.work_dir) | {"dtype": args.dtype}
    engines = [("tokenmill", sys.executable, {})] + ([("vllm", args.vllm_python, VLLM_ENV)] if args.vllm_python else [])
    modes = {"tokenmill": ("base", "adapters", "base_eager"), "vllm": ("base", "adapters")}
    runs = {
        f"{engine}_{mode}": call(__file__, python, engine, spec | {"mode": mode}, env)
        for engine, python, env in engines
        for mode in modes[engine]
    }
    report: dict[str, Any] = {"runs": runs}

    def ratio(a: str, b: str) -> float:
        return round(runs[a]["output_tok_s"] / runs[b]["output_tok_s"], 3)

    report["tokenmill_adapters_vs_base"] = ratio("tokenmill_adapters", "tokenmill_base")
    report["tokenmill_eager_vs_base"] = ratio("tokenmill_base_eager", "tokenmill_base")
    if args.vllm_python:
        report["vllm_adapters_vs_base"] = ratio("vllm_adapters", "vllm_base")
        report["tokenmill_vs_vllm_with_adapters"] = ratio("tokenmill_adapters", "vllm_adapters")
    print(json.dumps(report, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    save("lora", report)


if __name__ == "__main__":
    main()
