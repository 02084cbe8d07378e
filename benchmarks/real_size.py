"""tokenmill against llama.cpp on random-weight models of real shapes (Llama-3.2-1B, Qwen3-4B), as GGUF.

The model is written once as an F16 GGUF of random weights (``gguf``'s writer, the keys and tensor
names llama.cpp's converter writes, a placeholder vocabulary of the real size) and quantized by
llama.cpp's own quantizer (``llama_model_quantize``) to each of ``--formats`` (Q4_K_M, Q8_0). For each
file, tokenmill and llama.cpp run one after another, each measurement in a fresh process, ``--starts``
processes per engine (alternating), with the same threads and greedy decoding:

- ``decode_ms_per_token``: batch 1 at a 512-token context (a 512-token prompt, then 64 tokens):
  (time of 65 tokens - time of the first) / 64, median of ``--repeats`` in the process; the figure
  of each start is kept (``spread`` = max / min over the starts);
- ``prefill_tok_s``: a fresh 512-token prompt, one output token, median of ``--repeats``;
- ``concurrent_tok_s``: 16 requests of 256 prompt and 128 output tokens submitted at once
  (llama.cpp: 16 parallel slots with continuous batching, ``compare_llamacpp_gguf.llama_slots_throughput``);
- ``ready_s``: from the engine's constructor to the first token of a short prompt; tokenmill's
  first start (an empty cache) and a later one;
- the roof: the machine's streaming read rate (``tokenmill.bench.roofline.read_gbps``), measured
  before each file's runs, and the fraction of it batch-1 decode reaches: the bytes one token reads
  (every tensor of the file but an untied embedding table, which is only indexed) / ms per token.

    python benchmarks/real_size.py --shape llama-3.2-1b --formats Q4_K_M Q8_0 --starts 3 --json

llama.cpp lives in its own venv (``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python``),
reached only through a subprocess running this file with ``--worker``. The files are kept under
``--work-dir`` between runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fresh_process import answer, call  # this script's folder is on sys.path
from results import save

LLAMA_PYTHON = "/work/llama-venv/bin/python"
CONTEXT, DECODE_TOKENS, PREFILL_TOKENS = 512, 64, 512
CONCURRENT, CONCURRENT_PROMPT, CONCURRENT_OUT = 16, 256, 128
FTYPES = {"Q4_K_M": 15, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "arch": "llama", "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "head_dim": 64,
        "ffn": 8192, "vocab": 128256, "rope_base": 500000.0, "eps": 1e-5, "qk_norm": False,
    },
    "qwen3-4b": {
        "arch": "qwen3", "hidden": 2560, "layers": 36, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "ffn": 9728, "vocab": 151936, "rope_base": 1000000.0, "eps": 1e-6, "qk_norm": True,
    },
}  # fmt: skip
"""The real models' shapes (both tie their LM head to the embeddings)."""


def tensor_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape ([rows, columns] for matrices) of a model of ``shape``."""
    h, d, ffn = shape["hidden"], shape["head_dim"], shape["ffn"]
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape["vocab"], h), "output_norm.weight": (h,)}
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        out |= {
            b + "attn_norm.weight": (h,),
            b + "attn_q.weight": (shape["heads"] * d, h),
            b + "attn_k.weight": (shape["kv_heads"] * d, h),
            b + "attn_v.weight": (shape["kv_heads"] * d, h),
            b + "attn_output.weight": (h, shape["heads"] * d),
            b + "ffn_norm.weight": (h,),
            b + "ffn_gate.weight": (ffn, h),
            b + "ffn_up.weight": (ffn, h),
            b + "ffn_down.weight": (h, ffn),
        }
        if shape["qk_norm"]:
            out |= {b + "attn_q_norm.weight": (d,), b + "attn_k_norm.weight": (d,)}
    return out


def write_f16(shape_name: str, out: Path) -> None:
    """An F16 GGUF of a random model of ``SHAPES[shape_name]`` (1-D norms F32 ones), written tensor by
    tensor (never the whole model in memory)."""
    import gguf
    import numpy as np
    from compare_llamacpp import add_fake_vocab

    shape = SHAPES[shape_name]
    arch = shape["arch"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"random {shape_name}")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_fake_vocab(writer, shape["vocab"])
    shapes = tensor_shapes(shape)
    for name, dims in shapes.items():
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, dims in shapes.items():
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            data = rng.standard_normal(dims, dtype=np.float32)
            data *= 0.02 if name != "token_embd.weight" else 1.0
            writer.write_tensor_data(data.astype(np.float16))
    writer.close()


def decode_prompt() -> list[int]:
    return [1000 + i for i in range(CONTEXT)]


def fresh_prompt(repeat: int, length: int = PREFILL_TOKENS) -> list[int]:
    """A prompt of its own per repeat (no prefix-cache hit between them)."""
    return [5000 + (repeat + 1) * length + i for i in range(length)]


def concurrent_prompts() -> list[list[int]]:
    return [fresh_prompt(100 + r, CONCURRENT_PROMPT) for r in range(CONCURRENT)]


def measure(spec: dict[str, Any], run) -> dict[str, Any]:  # noqa: ANN001 (run: prompt, tokens -> seconds)
    """The decode and prefill figures of one process, ``run`` timing one greedy generation."""
    run(decode_prompt(), DECODE_TOKENS + 1)  # warm-up
    decode = [
        (run(decode_prompt(), DECODE_TOKENS + 1) - run(decode_prompt(), 1)) / DECODE_TOKENS
        for _ in range(spec["repeats"])
    ]
    prefill = [PREFILL_TOKENS / run(fresh_prompt(r), 1) for r in range(spec["repeats"])]
    return {"decode_ms_per_token": 1000 * statistics.median(decode), "prefill_tok_s": statistics.median(prefill)}


def tokenmill_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=spec["model"], cpu_threads=spec["threads"], max_context_len=2048, **spec.get("options", {}))
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    ready = time.perf_counter() - start
    if spec["task"] == "ready":
        return {"ready_s": ready}

    def run(prompt: list[int], n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t

    if spec["task"] == "decode":
        return {"ready_s": ready, **measure(spec, run)}
    params = SamplingParams(temperature=0, max_tokens=CONCURRENT_OUT, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in concurrent_prompts()], params, use_tqdm=False)
    return {"concurrent_tok_s": CONCURRENT * CONCURRENT_OUT / (time.perf_counter() - t)}


def llama_task(spec: dict[str, Any]) -> dict[str, Any]:
    threads = spec["threads"]
    if spec["task"] == "concurrent":
        from compare_llamacpp_gguf import llama_slots_throughput

        work = {**spec, "prompts": concurrent_prompts(), "outs": [CONCURRENT_OUT] * CONCURRENT}
        return {"concurrent_tok_s": llama_slots_throughput(work, CONCURRENT)}
    from compare_llamacpp_gguf import llama_timer
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(spec["model"], n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    next(iter(llm.generate([5, 6, 7], temp=0, reset=True)))
    ready = time.perf_counter() - start
    if spec["task"] == "ready":
        return {"ready_s": ready}
    return {"ready_s": ready, **measure(spec, llama_timer(llm))}


def quantize_task(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[spec["format"]]
    params.nthread = spec["threads"]
    return {"rc": int(llama_cpp.llama_model_quantize(spec["model"].encode(), spec["out"].encode(), params))}


def roof_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill.bench.roofline import read_gbps

    return {"read_gbps": read_gbps()}


def decode_bytes(path: Path) -> int:
    """Bytes one batch-1 decode step reads: every tensor but an untied embedding table."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [r[key] for r in runs if key in r]
    return {"median": statistics.median(values), "runs": values, "spread": max(values) / min(values)}


def bench_file(path: Path, args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    roof = call(__file__, sys.executable, "roof", {})["read_gbps"]
    engines = {"tokenmill": (sys.executable, "tokenmill"), "llama.cpp": (args.llama_python, "llama")}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    cache = tempfile.mkdtemp(dir=args.work_dir)  # tokenmill's cache: its first start is the empty one
    for _start in range(args.starts):
        for name, (python, task) in engines.items():
            env = {"TOKENMILL_CACHE_DIR": cache} if name == "tokenmill" else None
            runs[name].append(call(__file__, python, task, {**base, "model": str(path), "task": "decode"}, env))
            print(json.dumps({path.name: {name: runs[name][-1]}}), file=sys.stderr, flush=True)
    result: dict[str, Any] = {"read_gbps": roof, "decode_bytes": decode_bytes(path)}
    for name, (python, task) in engines.items():
        env = {"TOKENMILL_CACHE_DIR": cache} if name == "tokenmill" else None
        concurrent = call(__file__, python, task, {**base, "model": str(path), "task": "concurrent"}, env)
        spec = {**base, "model": str(path), "task": "ready"}
        ready = [call(__file__, python, task, spec, env)["ready_s"] for _ in range(2)]
        decode = summary(runs[name], "decode_ms_per_token")
        result[name] = {
            "decode_ms_per_token": decode,
            "prefill_tok_s": summary(runs[name], "prefill_tok_s")["median"],
            "concurrent_tok_s": concurrent["concurrent_tok_s"],
            "ready_s": {"first start": runs[name][0]["ready_s"], "later starts": ready},
            "roof_fraction": result["decode_bytes"] / (decode["median"] / 1000) / (roof * 1e9),
        }
    shutil.rmtree(cache, ignore_errors=True)
    ours, theirs = result["tokenmill"], result["llama.cpp"]
    result["ratios"] = {
        "decode (ms/token, tokenmill / llama.cpp)": ours["decode_ms_per_token"]["median"]
        / theirs["decode_ms_per_token"]["median"],
        "prefill (tok/s)": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
        "concurrent (tok/s)": ours["concurrent_tok_s"] / theirs["concurrent_tok_s"],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--formats", nargs="+", choices=sorted(FTYPES), default=["Q4_K_M", "Q8_0"])
    parser.add_argument("--llama-python", default=LLAMA_PYTHON)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--starts", type=int, default=3, help="fresh processes per engine (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats in a process (default: %(default)s)")
    parser.add_argument("--option", nargs=2, action="append", default=[], metavar=("NAME", "JSON"),
                        help="a tokenmill LLM option, e.g. --option quantized_activations '\"int8\"'")  # fmt: skip
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-real-size"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        tasks = {"tokenmill": tokenmill_task, "llama": llama_task, "quantize": quantize_task, "roof": roof_task}
        answer(args.worker, tasks)
        return
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    f16 = work_dir / f"{args.shape}.F16.gguf"
    if not f16.is_file():
        write_f16(args.shape, f16.with_suffix(".partial"))
        f16.with_suffix(".partial").rename(f16)
    base = {"threads": args.threads, "repeats": args.repeats, "options": {k: json.loads(v) for k, v in args.option}}
    results: dict[str, Any] = {"shape": args.shape, "options": base["options"]}
    for fmt in args.formats:
        path = work_dir / f"{args.shape}.{fmt}.gguf"
        if not path.is_file():
            spec = {"model": str(f16), "out": str(path), "format": fmt, "threads": args.threads}
            call(__file__, args.llama_python, "quantize", spec)
        results[fmt] = bench_file(path, args, base)
        print(json.dumps({fmt: results[fmt]["ratios"]}), file=sys.stderr, flush=True)
    print(json.dumps(results) if args.json else json.dumps(results, indent=1))
    save(f"real_size_{args.shape}", results)


if __name__ == "__main__":
    main()
