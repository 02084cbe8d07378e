"""tokenmill against llama.cpp on the same GGUF files: batch-1 decode, prefill, throughput, load time.

Files: the default model's GGUF (SmolLM2-135M-Instruct, Q4_1 projections, Q8_0 embeddings; fetched
by ``tokenmill fetch-default-model``) and a Q4_K_M file of the same model made from it by llama.cpp's
own quantizer (``llama_model_quantize``, requantizing: the numbers are for speed, not quality).
Both engines use the same threads (``--threads``) and greedy decoding, one after another, each run in
a fresh process, never together. Per engine and file:

- ``decode_ms_per_token``: a 16-token prompt then 128 tokens, EOS ignored; (time of 128 - time of
  the prompt's first token) / 127, median of ``--repeats`` after a warm-up;
- ``prefill_tok_s``: a 512-token prompt (a new one each repeat), one output token;
- ``throughput_tok_s``: output tokens/s over the reference workload's lengths (``--requests``
  requests, prompts 32-512 tokens, outputs 32-256); tokenmill: all submitted at once; llama.cpp: as
  llama-server serves them, in parallel slots with continuous batching (each step one batch of every
  generating slot's next token, then prompt chunks up to ``n_batch``; a finished slot takes the next
  request), through the binding's low-level API, for each of ``--llama-slots`` (1 slot: one request
  after another) with a KV stream per slot; its best is the one compared (``throughput_by_slots``
  has them all);
- tokenmill only, ``load_to_first_token_s``: a fresh process from ``LLM(model=...)`` to the first
  token of a short prompt, for the GGUF (conversion cached, and a first run with an empty cache) and
  for the same model as a bf16 safetensors checkpoint (written once by transformers from the GGUF).

Ratios: tokenmill / llama.cpp decode ms per token (the target is <= 0.9), tokenmill / llama.cpp
throughput (target >= 3), GGUF / safetensors load (target <= 1.5).

    python benchmarks/compare_llamacpp_gguf.py --json [--llama-python /work/llama-venv/bin/python]

llama.cpp lives in its own venv (see ``compare_llamacpp.py`` for the build), reached only through a
subprocess running this file with ``--worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from results import save  # this script's folder is on sys.path

LLAMA_PYTHON = "/work/llama-venv/bin/python"
DECODE_PROMPT, DECODE_TOKENS, PREFILL_TOKENS = 16, 128, 512
Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


def workload(requests: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    from tokenmill.bench.workload import make_workload

    work = make_workload(num_prompts=requests, vocab_size=vocab, seed=0)
    return work.prompts, work.output_lens


def fresh_prompt(repeat: int) -> list[int]:
    """A 512-token prompt of its own per repeat (no prefix-cache hit between them)."""
    return [1000 + repeat * PREFILL_TOKENS + i for i in range(PREFILL_TOKENS)]


def tokenmill_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, SamplingParams

    start = time.perf_counter()
    activations = spec.get("quantized_activations", "int16")
    llm = LLM(
        model=spec["model"],
        cpu_threads=spec["threads"],
        dtype=spec.get("dtype", "auto"),
        quantized_activations=activations,
    )
    if spec["task"] == "load":
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
        return {"load_to_first_token_s": time.perf_counter() - start}

    def run(prompt: list[int], n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t

    decode_prompt = list(range(100, 100 + DECODE_PROMPT))
    run(decode_prompt, DECODE_TOKENS)  # warm-up
    decode = [
        (run(decode_prompt, DECODE_TOKENS) - run(decode_prompt, 1)) / (DECODE_TOKENS - 1)
        for _ in range(spec["repeats"])
    ]
    prefill = [PREFILL_TOKENS / run(fresh_prompt(r), 1) for r in range(spec["repeats"])]
    prompts, outs = workload(spec["requests"], spec["vocab"])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {
        "decode_ms_per_token": 1000 * statistics.median(decode),
        "prefill_tok_s": statistics.median(prefill),
        "throughput_tok_s": sum(outs) / (time.perf_counter() - t),
    }


def llama_task(spec: dict[str, Any]) -> dict[str, Any]:
    from llama_cpp import Llama

    threads = spec["threads"]
    llm = Llama(spec["model"], n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    run = llama_timer(llm)
    decode_prompt = list(range(100, 100 + DECODE_PROMPT))
    run(decode_prompt, DECODE_TOKENS)
    decode = [
        (run(decode_prompt, DECODE_TOKENS) - run(decode_prompt, 1)) / (DECODE_TOKENS - 1)
        for _ in range(spec["repeats"])
    ]
    prefill = [PREFILL_TOKENS / run(fresh_prompt(r), 1) for r in range(spec["repeats"])]
    llm.close()  # its context's memory, before the slots' own
    by_slots = {slots: llama_slots_throughput(spec, slots) for slots in spec["slots"]}
    return {
        "decode_ms_per_token": 1000 * statistics.median(decode),
        "prefill_tok_s": statistics.median(prefill),
        "throughput_tok_s": max(by_slots.values()),
        "throughput_by_slots": by_slots,
    }


def llama_timer(llm: Any) -> Callable[[list[int], int], float]:
    """``run(prompt, n)``: seconds llama.cpp's ``llm`` (a ``llama_cpp.Llama``) takes for ``n`` greedy
    tokens after ``prompt``, from a fresh context."""

    def run(prompt: list[int], n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        for i, _ in enumerate(llm.generate(prompt, temp=0, reset=True)):
            if i + 1 == n:
                break
        return time.perf_counter() - t

    return run


def llama_slots_throughput(spec: dict[str, Any], slots: int, n_batch: int = 2048) -> float:
    """Output tokens/s of llama.cpp serving ``spec``'s requests greedily in ``slots`` parallel slots."""
    import llama_cpp as lc
    import numpy as np

    prompts, outs = spec["prompts"], spec["outs"]
    model = lc.llama_model_load_from_file(spec["model"].encode(), lc.llama_model_default_params())
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    params = lc.llama_context_default_params()
    params.n_ctx = slots * max(len(p) + n for p, n in zip(prompts, outs))
    params.n_batch, params.n_seq_max, params.kv_unified = n_batch, slots, False
    params.n_threads = params.n_threads_batch = spec["threads"]
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(n_batch, 0, 1)
    waiting = list(range(len(prompts)))[::-1]

    def add(token: int, pos: int, slot: int, rows: list[tuple[int, int]] | None) -> None:
        """Appends one token of ``slot``'s sequence to the batch; with ``rows``, its logits are wanted."""
        n = batch.n_tokens
        batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.seq_id[n][0] = token, pos, 1, slot
        batch.logits[n] = rows is not None
        if rows is not None:
            rows.append((n, slot))
        batch.n_tokens = n + 1

    running: list[dict[str, int] | None] = [None] * slots  # request, prompt tokens fed, tokens made, last token
    t = time.perf_counter()
    while waiting or any(running):
        for slot in range(slots):
            if running[slot] is None and waiting:
                running[slot] = {"request": waiting.pop(), "fed": 0, "made": 0, "last": -1}
        rows: list[tuple[int, int]] = []  # (batch position whose logits are wanted, slot)
        batch.n_tokens = 0
        for slot, state in enumerate(running):  # every generating slot's next token first
            if state is not None and state["made"] > 0:
                add(state["last"], len(prompts[state["request"]]) + state["made"] - 1, slot, rows)
        for slot, state in enumerate(running):  # then prompt chunks while the batch has room
            if state is None or state["made"] > 0:
                continue
            prompt = prompts[state["request"]]
            while state["fed"] < len(prompt) and batch.n_tokens < n_batch:
                add(prompt[state["fed"]], state["fed"], slot, rows if state["fed"] == len(prompt) - 1 else None)
                state["fed"] += 1
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for row, slot in rows:
            state = running[slot]
            state["last"] = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(vocab,)).argmax())
            state["made"] += 1
            if state["made"] == outs[state["request"]]:
                lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), slot, -1, -1)
                running[slot] = None
    seconds = time.perf_counter() - t
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return sum(outs) / seconds


def llama_quantize(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_K_M
    params.allow_requantize = True
    params.nthread = spec["threads"]
    code = llama_cpp.llama_model_quantize(spec["model"].encode(), spec["out"].encode(), params)
    return {"rc": int(code)}


def call(python: str, task: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``task`` in a fresh process of ``python``; its one-line JSON answer."""
    done = subprocess.run(
        [python, __file__, "--worker", task, json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{task} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def safetensors_copy(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """The GGUF's model as a safetensors checkpoint in ``dtype`` (transformers dequantizes), written once."""
    if not (out / "model.safetensors").is_file():
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
        out.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()  # (save_pretrained refuses a model loaded from GGUF)
        config.pop("quantization_config", None)  # the saved weights are plain floats
        config["architectures"] = [type(model).__name__]
        (out / "config.json").write_text(json.dumps(config, indent=1))
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            del tensors["lm_head.weight"]  # the embedding table's copy
        save_file(tensors, str(out / "model.safetensors"))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", default=LLAMA_PYTHON)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="tokenmill's dtype (default: %(default)s, the CPU's fast one)")
    parser.add_argument(
        "--quantized-activations", default="int16", help="tokenmill's quantized_activations (default: %(default)s)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64, help="throughput requests (default: %(default)s)")
    parser.add_argument(
        "--llama-slots", type=int, nargs="+", default=[1, 8, 16], help="llama.cpp's parallel slots to try (throughput)"
    )
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-gguf"))
    parser.add_argument("--parts", nargs="+", choices=["engines", "load"], default=["engines", "load"])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        task, spec = args.worker[0], json.loads(args.worker[1])
        work = {"tokenmill": tokenmill_task, "llama": llama_task, "quantize": llama_quantize}[task]
        print(json.dumps(work(spec)))
        return

    from tokenmill.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_FILE

    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    default = DEFAULT_MODEL_DIR / DEFAULT_MODEL_FILE
    q4km = work_dir / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if not q4km.is_file():
        call(args.llama_python, "quantize", {"model": str(default), "out": str(q4km), "threads": args.threads})
    prompts, outs = workload(args.requests, 49152)
    base = {"threads": args.threads, "repeats": args.repeats, "requests": args.requests, "vocab": 49152}
    base["quantized_activations"] = args.quantized_activations
    results: dict[str, Any] = {}
    for name, path in (("Q4_1 (default model)", default), ("Q4_K_M", q4km)) if "engines" in args.parts else ():
        ours = call(sys.executable, "tokenmill", {**base, "model": str(path), "task": "bench", "dtype": args.dtype})
        llama_spec = {**base, "model": str(path), "prompts": prompts, "outs": outs, "slots": args.llama_slots}
        theirs = call(args.llama_python, "llama", llama_spec)
        results[name] = {
            "tokenmill": ours,
            "llama.cpp": theirs,
            "decode_ratio": ours["decode_ms_per_token"] / theirs["decode_ms_per_token"],
            "prefill_ratio": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
            "throughput_ratio": ours["throughput_tok_s"] / theirs["throughput_tok_s"],
        }
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)  # progress: a run takes minutes
    if "load" in args.parts:
        results["load_to_first_token_s"] = load_times(default, work_dir, base, args.repeats)
    print(json.dumps(results) if args.json else json.dumps(results, indent=1))
    save("compare_llamacpp_gguf", results)


def load_times(default: Path, work_dir: Path, base: dict[str, Any], repeats: int) -> dict[str, float]:
    """Seconds from a fresh process's ``LLM(model=...)`` to its first token, median of ``repeats``."""
    folder = safetensors_copy(default, work_dir / "smollm2-135m-instruct-bf16")
    loads = {}
    for name, path, fresh_cache in (
        ("gguf, first run (empty cache)", default, True),
        ("gguf, converted", default, False),
        ("safetensors bf16", folder, False),
    ):
        spec = {**base, "model": str(path), "task": "load"}
        times = []
        for _ in range(repeats):
            env = {"TOKENMILL_CACHE_DIR": tempfile.mkdtemp(dir=work_dir)} if fresh_cache else None
            times.append(call(sys.executable, "tokenmill", spec, env)["load_to_first_token_s"])
        loads[name] = statistics.median(times)
    loads["ratio converted gguf / safetensors"] = loads["gguf, converted"] / loads["safetensors bf16"]
    loads["ratio first run / safetensors"] = loads["gguf, first run (empty cache)"] / loads["safetensors bf16"]
    return loads


if __name__ == "__main__":
    main()
