"""Embedding throughput: tokenmill's ``LLM.embed`` against sentence-transformers, same model, same threads.

The model is a random decoder of bge-small's shape (hidden 384, 12 layers, 12 heads, MLP 1536; a
Qwen3 decoder as Qwen3-Embedding is) with the default model's tokenizer, written once to
``--work-dir``; the texts are 1,000 seeded sentences of 8-256 words (``--sentences``). Each engine
runs in a fresh process, one after another, with 2 threads: sentence-transformers (its
``Transformer`` + last-token ``Pooling`` + ``Normalize``, batches of 32, fp32) in ``--st-python``
(a venv with sentence-transformers; it is never a tokenmill dependency), then tokenmill in fp32
and at its default dtype. Prints sentences/s, the ratios, and the cosine agreement of the two
engines' fp32 embeddings.

    python -m venv --system-site-packages ST && ST/bin/pip install sentence-transformers
    python benchmarks/embeddings.py --st-python ST/bin/python --json
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

from fresh_process import answer, call

THREADS = 2


def make_model(folder: Path) -> Path:
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


def sentences(n: int) -> list[str]:
    rng = random.Random(0)
    words = "the a model token engine cache page request batch text answer question value time".split()
    words += "inference server memory thread kernel vector prompt output fast small large data".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 256))) for _ in range(n)]


def tokenmill_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, PoolingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], cpu_threads=THREADS)
    llm.embed(spec["texts"][:8], PoolingParams(), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(spec["texts"], PoolingParams(), use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return {"elapsed_s": elapsed, "embeddings": [o.outputs.embedding for o in outputs[: spec["keep"]]]}


def st_task(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer, models

    torch.set_num_threads(THREADS)
    transformer = models.Transformer(spec["model"], max_seq_length=1024)
    transformer.tokenizer.pad_token = transformer.tokenizer.pad_token or transformer.tokenizer.eos_token
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    model.encode(spec["texts"][:8], batch_size=32)  # warm-up
    start = time.perf_counter()
    vectors = model.encode(spec["texts"], batch_size=32)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "embeddings": vectors[: spec["keep"]].tolist()}


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    import torch

    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=-1).tolist()


def main(args: argparse.Namespace) -> None:
    model = str(make_model(Path(args.work_dir) / "qwen3-bge-small-shape"))
    texts = sentences(args.sentences)
    spec = {"model": model, "texts": texts, "keep": 50}
    st = call(__file__, str(args.st_python), "st", spec)
    fp32 = call(__file__, sys.executable, "tokenmill", {**spec, "dtype": "float32"})
    auto = call(__file__, sys.executable, "tokenmill", {**spec, "dtype": "auto"})
    rate = {name: len(texts) / run["elapsed_s"] for name, run in (("st", st), ("fp32", fp32), ("auto", auto))}
    agreement = cosines(st["embeddings"], fp32["embeddings"])
    result = {
        "sentences": len(texts),
        "sentence_transformers_fp32_per_s": rate["st"],
        "tokenmill_fp32_per_s": rate["fp32"],
        "tokenmill_default_dtype_per_s": rate["auto"],
        "ratio_fp32": rate["fp32"] / rate["st"],
        "ratio_default_dtype": rate["auto"] / rate["st"],
        "min_cosine_fp32_vs_st": min(agreement),
    }
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--st-python", type=Path, default=None)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-embeddings"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    if ARGS.worker:
        answer(ARGS.worker, {"tokenmill": tokenmill_task, "st": st_task})
    elif ARGS.st_python is None:
        sys.exit("--st-python is needed (a venv with sentence-transformers)")
    else:
        main(ARGS)
