"""Quantizing at load on a real model: speed against bf16 and agreement with the fp32 model.

The model is SmolLM2-135M-Instruct (the default model's GGUF, written once as an fp32 safetensors
checkpoint by transformers, so every variant below loads the same weights). The corpus is this
repository's documentation (``docs/*.md``), tokenized by the model, cut into ``--prompts`` prompts of
``--prompt-len`` tokens. The fp32 model's two most likely next tokens at every position
(``prompt_logprobs=2``) say where its choice is clear: a margin of at least ``--margin`` nats between
the first and the second. Each variant (bf16 unquantized, then each ``--quantization`` at the
defaults) gives its most likely token at the same positions; its score is the fraction of the clear
positions where that is the fp32 model's choice. Batch-1 decode: a 16-token prompt, 128 tokens,
median ms/token of ``--repeats`` after a warm-up. Every variant runs in a fresh process, one after
another, with the same threads.

    python benchmarks/quantization_accuracy.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from results import save  # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parent.parent


def fp32_copy(out: Path) -> Path:
    """The default model's GGUF as an fp32 safetensors checkpoint (transformers dequantizes), written once."""
    from compare_llamacpp_gguf import safetensors_copy

    from tokenmill.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_FILE

    return safetensors_copy(DEFAULT_MODEL_DIR / DEFAULT_MODEL_FILE, out, "float32")


def corpus_prompts(folder: Path, count: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = "\n\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < count * length:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def variant_task(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant in this process: its top choices over the prompts, and its batch-1 decode time."""
    from tokenmill import LLM, SamplingParams

    quantization, _, group = (spec["quantization"] or "").partition("-g")
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        quantization=quantization or None,
        quantization_group_size=int(group) if group else None,
        cpu_threads=spec["threads"],
    )
    top = spec["top"]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top)
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    choices = []
    for output in outputs:
        for position in output.prompt_logprobs[1:]:  # (the first token has none)
            ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top]  # (the prompt's own token too)
            choices.append([[lp.logprob for _, lp in ranked], [token for token, _ in ranked]])
    decode = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompt = [{"prompt_token_ids": spec["prompts"][0][:16]}]
    llm.generate(prompt, decode, use_tqdm=False)
    times = []
    for _ in range(spec["repeats"]):
        started = time.perf_counter()
        llm.generate(prompt, decode, use_tqdm=False)
        times.append((time.perf_counter() - started) / 128 * 1000)
    return {"choices": choices, "decode_ms_per_token": statistics.median(times)}


def call(spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(spec, file)
        file.flush()
        done = subprocess.run([sys.executable, __file__, "--worker", file.name], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quantization", nargs="+", default=["int8", "int4"], help='schemes, "int4-g32" for a group size'
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--margin", type=float, default=1.0, help="nats between the fp32 model's first two choices")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-quantization"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(variant_task(json.loads(Path(args.worker).read_text()))))
        return
    folder = fp32_copy(Path(args.work_dir) / "smollm2-135m-instruct-fp32")
    prompts = corpus_prompts(folder, args.prompts, args.prompt_len)
    base = {"model": str(folder), "prompts": prompts, "threads": args.threads, "repeats": args.repeats}
    oracle = call({**base, "dtype": "float32", "quantization": None, "top": 2})
    clear = [i for i, (lps, _) in enumerate(oracle["choices"]) if len(lps) > 1 and lps[0] - lps[1] >= args.margin]
    results: dict[str, Any] = {"positions": len(oracle["choices"]), "clear_positions": len(clear)}
    results["fp32"] = {"decode_ms_per_token": oracle["decode_ms_per_token"]}
    variants = [("bf16", None)] + [(f"bf16 {q}", q) for q in args.quantization]
    for name, quantization in variants:
        run = call({**base, "dtype": "bfloat16", "quantization": quantization, "top": 1})
        agree = sum(run["choices"][i][1][0] == oracle["choices"][i][1][0] for i in clear)
        results[name] = {"decode_ms_per_token": run["decode_ms_per_token"], "clear_choices_kept": agree / len(clear)}
    bf16 = results["bf16"]["decode_ms_per_token"]
    for name, _ in variants[1:]:
        results[name]["decode_vs_bf16"] = results[name]["decode_ms_per_token"] / bf16
    print(json.dumps(results) if args.json else json.dumps(results, indent=1))
    save("quantization_accuracy", results)


if __name__ == "__main__":
    main()
