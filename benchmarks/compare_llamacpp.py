"""tokenmill against llama.cpp: batch-1 decode on CPU, the same random model, the same threads.

A random model of SmolLM2-135M's shape (``make_random_model``: 30 layers, hidden 576, untied LM
head) runs in tokenmill unquantized (the default dtype: bf16 on CPUs with native bf16) and with
``--quantization`` int8 / int4, then in llama.cpp (through llama-cpp-python) from GGUF files this
script writes from the same checkpoint: BF16, Q8_0, Q4_0 and Q4_1 projections. The engines run one
after another, never together. Each run is a 16-token prompt of token ids then 64 greedy output
tokens (EOS ignored), after a warm-up run; reported per engine and format, median of ``--repeats``:

- ``decode_ms_per_token``: the 63 tokens after the first (llama.cpp: the single-token evals timed
  alone; tokenmill: (time of 64 tokens - time of 1 token) / 63), the number the ratios use;
- ``ms_per_token``: the whole call (prompt included) / 64, as ``benchmarks/quantized_weights.py``.

Ratios are tokenmill / llama.cpp (above 1: tokenmill is slower): bf16 vs BF16, int8 vs Q8_0, int4
vs Q4_0 and int4 vs Q4_1 (tokenmill's int4 is asymmetric with a min per group, like Q4_1). As in
tokenmill's quantization, the GGUFs keep the token embedding and the LM head unquantized (BF16)
unless ``--quantize-lm-head``. A correctness check compares the last-prompt-position logits and the
first greedy tokens of every engine/format with transformers fp32 on the checkpoint (random weights
give flat logits: low-precision formats may pick another argmax; reported, never fatal). The random
model's near-uniform attention hides a wrong rotary layout, so ``correctness.rope_layout`` repeats
the check for the converter on a 2-layer copy with sharpened Q/K, beside a GGUF written without the
Q/K permutation as a negative control (it should fall out of greedy agreement). Also printed: the
CPU model and its flags of interest (avx512_vnni, avx512_bf16, amx), llama.cpp's system info.
Other load on the CPUs skews both engines (llama.cpp's spinning threads most): run on a quiet machine.

llama.cpp lives in a venv of its own, reached only through a subprocess (this file, run by the
venv's python with ``--worker``), so tokenmill never depends on it. Set it up once (a ~10-minute
build on 2 cores):

    python -m venv /work/llama-venv
    /work/llama-venv/bin/pip install numpy gguf
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/llama-venv/bin/pip install llama-cpp-python

(if it dies with "illegal instruction", rebuild with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" and ``--no-cache-dir --force-reinstall``).

    python benchmarks/compare_llamacpp.py --json [--repeats 3] [--llama-python /work/llama-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from results import save  # this script's folder is on sys.path

LLAMA_PYTHON = "/work/llama-venv/bin/python"
PROMPT_LEN = 16
OUTPUT_LEN = 64
CHECK_STEPS = 8
"""Greedy steps compared with transformers fp32 in the correctness check."""
GGUF_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
"""--llama-formats name -> gguf.GGMLQuantizationType name of the projection weights."""
PAIRS = [("unquantized", "bf16"), ("int8", "q8_0"), ("int4", "q4_0"), ("int4", "q4_1")]
"""(tokenmill quantization, llama.cpp format) pairs whose decode times are compared."""
CPU_FLAGS = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]


# ---------------------------------------------------------------- llama venv side (numpy, gguf, llama_cpp)


def read_safetensors(path: Path) -> dict[str, Any]:
    """The tensors of a safetensors file as float32 numpy arrays (F32, F16 or BF16 stored)."""
    import numpy as np

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        chunk, dtype = raw[start:end], info["dtype"]
        if dtype == "BF16":
            values = (chunk.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = chunk.view({"F32": np.float32, "F16": np.float16}[dtype]).astype(np.float32)
        tensors[name] = values.reshape(info["shape"])
    return tensors


def permute_rope(w: Any, n_head: int) -> Any:
    """HF's rotate-half Q/K rows to llama.cpp's interleaved layout (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's tensor name of an HF Llama tensor; None for ones it does not load."""
    fixed = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    if hf_name in fixed:
        return fixed[hf_name] + ".weight"
    parts = hf_name.split(".")  # model.layers.N.<module>.<proj>.weight
    if parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return None
    block = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }.get(".".join(parts[3:-1]))
    return f"blk.{parts[2]}.{block}.weight" if block else None


def add_fake_vocab(writer: Any, vocab_size: int) -> None:
    """A sentencepiece-style ("llama") vocabulary of the right size: <unk> <s> </s>, the 256 byte
    tokens, then placeholders. The benchmark feeds token ids, so only its size matters."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"tok{i}" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.NORMAL] * (vocab_size - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(model_dir: Path, out: Path, fmt: str, quantize_lm_head: bool, permute: bool = True) -> None:
    """Write the HF Llama checkpoint in ``model_dir`` as a GGUF: 1-D tensors F32, the projections in
    ``fmt``, the token embedding and LM head BF16 (or ``fmt`` when ``quantize_lm_head``). ``permute``
    False skips the Q/K rotary permutation: a wrong model, the correctness check's negative control."""
    import gguf
    import numpy as np

    cfg = json.loads((model_dir / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    qtype = gguf.GGMLQuantizationType[GGUF_TYPES[fmt]]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"{model_dir.name} {fmt}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 5 moved rope_theta here
    writer.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if fmt == "f32" else f"MOSTLY_{fmt.upper()}"))
    add_fake_vocab(writer, cfg["vocab_size"])
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(read_safetensors(path))
    for hf_name, data in tensors.items():
        name = gguf_name(hf_name)
        if name is None:
            continue
        if permute and name.endswith("attn_q.weight"):
            data = permute_rope(data, n_head)
        elif permute and name.endswith("attn_k.weight"):
            data = permute_rope(data, n_kv)
        if data.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
            continue
        head = name in ("token_embd.weight", "output.weight") and not quantize_lm_head
        ttype = gguf.GGMLQuantizationType.BF16 if head and fmt not in ("f32", "f16") else qtype
        if ttype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), ttype), raw_dtype=ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_greedy(llm: Any, prompt: list[int], n: int) -> tuple[list[int], float, float, Any]:
    """Greedy ``n`` tokens after ``prompt``: (tokens, prompt seconds, seconds of the n-1 decode
    steps, the prompt's last logits). Argmax over llama.cpp's own logits buffer, no copy."""
    import numpy as np

    vocab = llm.n_vocab()

    def step(tokens: list[int]) -> tuple[int, Any]:
        llm.eval(tokens)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
        return int(logits.argmax()), logits

    llm.reset()
    started = time.perf_counter()
    token, logits = step(prompt)
    first_logits = logits.copy()
    prompted = time.perf_counter()
    out = [token]
    for _ in range(n - 1):
        token, _ = step([token])
        out.append(token)
    return out, prompted - started, time.perf_counter() - prompted, first_logits


def llama_load(spec: dict[str, Any]) -> Any:
    """A llama_cpp.Llama of ``spec["gguf"]`` with ``spec["threads"]`` threads."""
    import llama_cpp

    threads = spec["threads"]
    return llama_cpp.Llama(
        model_path=spec["gguf"], n_threads=threads, n_threads_batch=threads, n_ctx=256, n_batch=64, verbose=False
    )


def llama_check(llm: Any, spec: dict[str, Any]) -> list[int]:
    """The correctness check's greedy tokens; the prompt's last logits saved to ``spec["logits_out"]``."""
    import numpy as np

    tokens, _, _, logits = llama_greedy(llm, spec["prompt"], CHECK_STEPS)
    np.save(spec["logits_out"], logits)
    return tokens


def llama_bench(spec: dict[str, Any]) -> dict[str, Any]:
    """One GGUF in llama.cpp: the correctness check, a warm-up, then ``repeats`` timed greedy runs."""
    import llama_cpp

    llm = llama_load(spec)
    prompt, n = spec["prompt"], spec["output_len"]
    check = llama_check(llm, spec)
    llama_greedy(llm, prompt, n)  # warm-up
    decode, total = [], []
    for _ in range(spec["repeats"]):
        _, prompt_s, decode_s, _ = llama_greedy(llm, prompt, n)
        decode.append(decode_s / (n - 1) * 1e3)
        total.append((prompt_s + decode_s) / n * 1e3)
    return {
        "decode_ms_per_token": round(statistics.median(decode), 2),
        "ms_per_token": round(statistics.median(total), 2),
        "file_mb": round(Path(spec["gguf"]).stat().st_size / 2**20, 1),
        "check_tokens": check,
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


def worker(task: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Entry point in the llama venv (``--worker``)."""
    if task == "convert":
        model_dir = Path(spec["model"])
        for fmt, out in spec["outputs"].items():
            write_gguf(model_dir, Path(out), fmt, spec["quantize_lm_head"], spec.get("permute", True))
        return {"written": list(spec["outputs"].values())}
    if task == "check":
        return {"check_tokens": llama_check(llama_load(spec), spec)}
    return llama_bench(spec)


# ---------------------------------------------------------------- tokenmill side (shared python)


def call_worker(python: str, task: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``worker(task, spec)`` in the llama venv; its result is the last line of its stdout."""
    cmd = [python, __file__, "--worker", task, json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama venv worker {task} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gguf_files(model: Path, formats: list[str], args: argparse.Namespace) -> dict[str, Path]:
    """The GGUF of each format beside the checkpoint, written (in the llama venv) where missing or stale."""
    folder = model.parent / f"{model.name}-gguf"
    folder.mkdir(exist_ok=True)
    suffix = "-qhead" if args.quantize_lm_head else ""
    files = {fmt: folder / f"{fmt}{suffix}.gguf" for fmt in formats}
    newest = max(p.stat().st_mtime for p in model.glob("*.safetensors"))
    missing = {fmt: str(p) for fmt, p in files.items() if not p.is_file() or p.stat().st_mtime < newest}
    if missing:
        spec = {"model": str(model), "outputs": missing, "quantize_lm_head": args.quantize_lm_head}
        call_worker(args.llama_python, "convert", spec)
    return files


def reference(model: Path, prompt: list[int]) -> tuple[list[int], Any]:
    """transformers fp32: greedy CHECK_STEPS tokens (no cache, EOS ignored) and the prompt's last logits."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids, out, first = torch.tensor([prompt]), [], None
    with torch.inference_mode():
        for _ in range(CHECK_STEPS):
            logits = hf(ids).logits[0, -1]
            first = logits.clone() if first is None else first
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out, first.numpy()


def make_rope_check_model(model: Path, layers: int = 2, sharpen: float = 4.0) -> Path:
    """A copy of the checkpoint's first ``layers`` layers with Q and K scaled by ``sharpen``. The
    random model's attention is near uniform (init std 0.02), so its logits barely depend on the
    rotary layout: a GGUF without the Q/K permutation matches transformers there as well as a right
    one. Sharpened attention makes a wrong layout show."""
    import torch
    from safetensors.torch import load_file, save_file

    out = model.parent / f"{model.name}-ropecheck"
    if (out / "model.safetensors").is_file():
        return out
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(path))
    kept = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
            continue
        kept[name] = t * sharpen if name.endswith(("q_proj.weight", "k_proj.weight")) else t
    config = json.loads((model / "config.json").read_text())
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=layers), indent=2))
    save_file({k: v.contiguous() for k, v in kept.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def rope_check(model: Path, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """The converter against transformers fp32 where the rotary layout matters (:func:`make_rope_check_model`):
    a BF16 GGUF, and the same without the Q/K permutation as a negative control."""
    import numpy as np

    sharp = make_rope_check_model(model)
    ref_tokens, ref_logits = reference(sharp, prompt)
    result: dict[str, Any] = {"model": "first 2 layers, q/k x4", "reference_tokens": ref_tokens}
    for label, permute in (("bf16", True), ("bf16_unpermuted_control", False)):
        path = sharp.parent / f"{sharp.name}-gguf" / f"{label}.gguf"
        path.parent.mkdir(exist_ok=True)
        spec = {"model": str(sharp), "outputs": {"bf16": str(path)}, "quantize_lm_head": False, "permute": permute}
        call_worker(args.llama_python, "convert", spec)
        logits_out = path.with_suffix(".logits.npy")
        spec = dict(gguf=str(path), threads=args.threads, prompt=prompt, logits_out=str(logits_out))
        tokens = call_worker(args.llama_python, "check", spec)["check_tokens"]
        result[label] = dict(agreement(ref_tokens, tokens), **logits_match(ref_logits, np.load(logits_out)))
    return result


def agreement(ref: list[int], tokens: list[int]) -> dict[str, Any]:
    """How far greedy ``tokens`` follow the reference: first argmax equal, length of the common prefix."""
    prefix = next((i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), min(len(ref), len(tokens)))
    return {"first_argmax_match": bool(tokens) and tokens[0] == ref[0], "prefix_match": f"{prefix}/{len(ref)}"}


def logits_match(ref: Any, logits: Any) -> dict[str, float]:
    """Cosine similarity and max abs difference of two logits vectors."""
    import numpy as np

    cos = float(np.dot(ref, logits) / (np.linalg.norm(ref) * np.linalg.norm(logits)))
    return {"logits_cosine": round(cos, 6), "logits_max_abs_diff": round(float(np.abs(ref - logits).max()), 5)}


def tokenmill_bench(model: Path, quantization: str | None, prompt: list[int], args: argparse.Namespace) -> dict:
    """tokenmill batch-1 decode: a warm-up, then per repeat a 1-token and a 64-token greedy call."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(model), quantization=quantization, skip_tokenizer_init=True, cpu_threads=args.threads)
    try:
        one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        full = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0)
        llm.generate([prompt], full, use_tqdm=False)  # warm-up
        decode, total, tokens = [], [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            one_s = time.perf_counter() - started
            started = time.perf_counter()
            tokens = llm.generate([prompt], full, use_tqdm=False)[0].outputs[0].token_ids
            full_s = time.perf_counter() - started
            decode.append((full_s - one_s) / (OUTPUT_LEN - 1) * 1e3)
            total.append(full_s / OUTPUT_LEN * 1e3)
        dtype = str(llm.engine.dtype).removeprefix("torch.")
    finally:
        llm.shutdown()
    return {
        "decode_ms_per_token": round(statistics.median(decode), 2),
        "ms_per_token": round(statistics.median(total), 2),
        "dtype": dtype,
        "check_tokens": list(tokens[:CHECK_STEPS]),
    }


def llama_run(path: Path, prompt: list[int], ref_logits: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One GGUF's :func:`llama_bench` in the llama venv, its prompt logits matched against the reference's."""
    import numpy as np

    logits_out = path.with_suffix(".logits.npy")
    spec = dict(gguf=str(path), threads=args.threads, prompt=prompt, output_len=OUTPUT_LEN, repeats=args.repeats)
    result = call_worker(args.llama_python, "bench", dict(spec, logits_out=str(logits_out)))
    return dict(result, **logits_match(ref_logits, np.load(logits_out)))


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and which flags of interest /proc/cpuinfo lists."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"model": name, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def ratios(tokenmill: dict[str, dict], llama: dict[str, dict]) -> dict[str, float]:
    """tokenmill / llama.cpp decode ms/token of each pair both sides ran (above 1: tokenmill slower)."""
    out = {}
    for tm, lc in PAIRS:
        if tm in tokenmill and lc in llama:
            label = tokenmill[tm]["dtype"] if tm == "unquantized" else tm
            out[f"{label}/{lc.upper()}"] = round(
                tokenmill[tm]["decode_ms_per_token"] / llama[lc]["decode_ms_per_token"], 3
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine/format (median)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of both engines (default: %(default)s)")
    parser.add_argument("--quantization", nargs="*", default=["int8", "int4"], help="tokenmill, beside unquantized")
    parser.add_argument(
        "--llama-formats", nargs="*", choices=sorted(GGUF_TYPES), default=["bf16", "q8_0", "q4_0", "q4_1"]
    )
    parser.add_argument("--quantize-lm-head", action="store_true", help="GGUF: embedding and LM head in the format too")
    parser.add_argument("--llama-python", default=LLAMA_PYTHON, help="python of the llama-cpp-python venv")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random model and the prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line")
    parser.add_argument("--worker", nargs=2, metavar=("TASK", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]))))
        return

    from tokenmill.bench.workload import make_random_model

    model = Path(make_random_model(preset="smollm2-135m-shape", seed=args.seed))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompt = [random.Random(args.seed).randrange(3, vocab) for _ in range(PROMPT_LEN)]
    files = gguf_files(model, args.llama_formats, args)

    tokenmill = {}
    for quantization in [None, *args.quantization]:
        tokenmill[quantization or "unquantized"] = tokenmill_bench(model, quantization, prompt, args)
    # after tokenmill's runs: once another thread of the process has run torch's OpenMP threads,
    # libgomp stops spinning between parallel regions and tokenmill's decode slows ~1.5x (measured)
    ref_tokens, ref_logits = reference(model, prompt)
    llama, version, system_info = {}, None, None
    for fmt, path in files.items():
        llama[fmt] = llama_run(path, prompt, ref_logits, args)
        version, system_info = llama[fmt].pop("version"), llama[fmt].pop("system_info")

    correctness = {"reference": "transformers fp32", "reference_tokens": ref_tokens}
    for side, results in (("tokenmill", tokenmill), ("llama_cpp", llama)):
        for name, r in results.items():
            correctness[f"{side}/{name}"] = dict(agreement(ref_tokens, r.pop("check_tokens")))
            if side == "llama_cpp":
                correctness[f"{side}/{name}"].update({k: r.pop(k) for k in ("logits_cosine", "logits_max_abs_diff")})
    correctness["rope_layout"] = rope_check(model, prompt, args)
    summary = {
        "cpu": cpu_info(),
        "setup": {
            "model": "random smollm2-135m-shape",
            "threads": args.threads,
            "prompt_tokens": PROMPT_LEN,
            "output_tokens": OUTPUT_LEN,
            "repeats": args.repeats,
            "gguf_lm_head": "quantized" if args.quantize_lm_head else "bf16",
            "llama_cpp_python": version,
            "llama_cpp_system_info": system_info,
        },
        "tokenmill": tokenmill,
        "llama_cpp": llama,
        "ratios_tokenmill_over_llamacpp": ratios(tokenmill, llama),
        "correctness": correctness,
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    save("compare_llamacpp", summary)


if __name__ == "__main__":
    main()
