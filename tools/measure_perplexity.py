"""Measure the tiny model's perplexity on its held-out stdlib files.

Loads the model folder with ``transformers`` (local files only), scores every held-out
token in non-overlapping windows, and compares against an add-one smoothed unigram
baseline estimated from the training files' tokens. The model card numbers come from here.

With ``--quantization int8|int4`` every projection the engine would quantize is replaced by its
quantized-then-dequantized value first (``tokenmill.model.quantization.fake_quantize_model``: the
numbers a model loaded with that ``quantization`` computes), which measures the quantization error;
``--int8-activations`` also quantizes each one's input as the panels layout (bf16 on a VNNI CPU) does.

Usage: ``python tools/measure_perplexity.py [--model-dir PATH] [--quantization int8|int4] [--int8-activations]
[--activation-passes 1|2]``
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from corpus import load_split, pack_stream, stream_windows
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.config import EngineConfig
from tokenmill.model.quantization import fake_quantize_model, quantization_scheme

TINY_MODEL_DIR = Path(__file__).resolve().parents[1] / "tokenmill" / "assets" / "tiny-model"


@torch.no_grad()
def model_nll(model: torch.nn.Module, windows: list[torch.Tensor], batch_size: int) -> float:
    """Summed next-token negative log-likelihood over all windows."""
    total = 0.0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        groups = [torch.stack([w for w in chunk if len(w) == length]) for length in sorted({len(w) for w in chunk})]
        for batch in groups:
            logits = model(input_ids=batch[:, :-1]).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
    return total


def measure(
    model_dir: Path,
    seq_len: int = 256,
    batch_size: int = 8,
    quantization: str | None = None,
    int8_activations: bool = False,
    activation_passes: int = 2,
) -> dict[str, float]:
    """Return model and unigram-baseline perplexities on the held-out files (the model's weights as
    ``quantization`` leaves them, if given, and with ``int8_activations`` their inputs too, in
    ``activation_passes`` int8 passes)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    scheme = quantization_scheme(EngineConfig(quantization=quantization))
    quantized = 0 if scheme is None else fake_quantize_model(model, scheme, int8_activations, activation_passes)
    vocab_size = model.config.vocab_size
    eos_id = tokenizer.eos_token_id
    train_texts, val_texts = load_split()

    def stream(texts: dict[str, str]) -> torch.Tensor:
        ids = tokenizer(list(texts.values()), add_special_tokens=False, verbose=False)["input_ids"]
        return pack_stream(ids, eos_id)

    val_stream = stream(val_texts)
    targets = val_stream[1:]
    windows = stream_windows(val_stream, seq_len, drop_last=False)
    nll = model_nll(model, windows, batch_size)

    counts = torch.bincount(stream(train_texts), minlength=vocab_size).double()
    log_probs = torch.log((counts + 1) / (counts.sum() + vocab_size))
    unigram_nll = -log_probs[targets].sum().item()
    return {
        "quantized_projections": quantized,
        "tokens": len(targets),
        "seq_len": seq_len,
        "model_ppl": math.exp(nll / len(targets)),
        "unigram_ppl": math.exp(unigram_nll / len(targets)),
    }


def main() -> None:
    """Print validation perplexity of the model and of the unigram baseline."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=TINY_MODEL_DIR)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None)
    parser.add_argument("--int8-activations", action="store_true", help="also quantize the projections' inputs")
    parser.add_argument(
        "--activation-passes", type=int, choices=(1, 2), default=2, help="int8 passes of the inputs (1: as llama.cpp)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(
        args.model_dir,
        args.seq_len,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
        activation_passes=args.activation_passes,
    )
    activations = f", int8 activations in {args.activation_passes} pass(es)" if args.int8_activations else ""
    print(f"quantized modules:        {result['quantized_projections']} ({args.quantization or 'none'}{activations})")
    print(f"held-out tokens:          {result['tokens']:,} ({args.seq_len}-token windows)")
    print(f"model perplexity:         {result['model_ppl']:.3f}")
    print(f"unigram perplexity:       {result['unigram_ppl']:.3f}")


if __name__ == "__main__":
    main()
