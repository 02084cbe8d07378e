"""Sampling filters (top-k / top-p / min-p) on real logits: tokenmill's (``engine/sampler.py``)
against the same filters computed by sorting every row's whole vocabulary (what it did before, and
what a plain implementation does), one thread, median of 32 batches; with how many of the 2,048 rows
each keeps other tokens than the filters' definition computed in fp64.

The logits are the default model's (SmolLM2-135M-Instruct, vocabulary 49,152; loaded through
transformers from the GGUF) over the README's first 2,048 tokens, 64 rows a batch.

    python benchmarks/sampler_filters.py --json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from results import save  # this script's folder is on sys.path

from tokenmill.default_model import DEFAULT_MODEL_FILE, default_model
from tokenmill.engine.sampler import _filter_logits

ROWS = 64
SETTINGS = {
    "T0.7 top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "T1 top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "T0.7 top_k 20 top_p 0.8": dict(temperature=0.7, top_k=20, top_p=0.8),
    "T1 min_p 0.05": dict(temperature=1.0, min_p=0.05),
}
FILTERS = (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))


def model_logits() -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32)
    readme = (folder.parents[2] / "README.md").read_text()
    ids = tokenizer(readme, return_tensors="pt").input_ids[:, :2048]
    with torch.no_grad():
        return model(ids).logits[0]


def full_sort_filter(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The same filters with every row's whole vocabulary sorted (the reference)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs < min_p[:, None] * probs[:, :1]
    positions = torch.arange(logits.shape[-1])
    drop |= (top_k[:, None] > 0) & (positions[None, :] >= top_k[:, None])
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= (top_p[:, None] < 1.0) & (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (positions[None, :] > 0)
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def measure(logits: torch.Tensor, params: dict, filter_logits: Callable[..., torch.Tensor]) -> dict[str, float]:
    """Median milliseconds of ``filter_logits`` over the batches of ``logits`` (divided by the
    temperature), and the rows whose kept tokens differ from the definition's (the reference in fp64)."""
    top_k, top_p, min_p = (torch.full((ROWS,), params.get(name, default)) for name, default in FILTERS)
    times, differing = [], 0
    for batch in range(logits.shape[0] // ROWS):
        rows = logits[batch * ROWS : (batch + 1) * ROWS] / params["temperature"]
        start = time.perf_counter()
        kept = filter_logits(rows, top_k, top_p, min_p).isfinite()
        times.append(time.perf_counter() - start)
        exact = full_sort_filter(rows.double(), top_k, top_p.double(), min_p.double()).isfinite()
        differing += int((kept != exact).any(dim=-1).sum())
    return {"ms": sorted(times)[len(times) // 2] * 1e3, "rows_differing_from_fp64": differing}


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    logits = model_logits()
    result = {}
    for name, params in SETTINGS.items():
        plain, ours = measure(logits, params, full_sort_filter), measure(logits, params, _filter_logits)
        result[name] = {"full_sort": plain, "tokenmill": ours, "speedup": plain["ms"] / ours["ms"]}
    print(json.dumps(result, indent=None if args.json else 1))
    save("sampler_filters", result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    main(parser.parse_args())
