"""Train tokenmill's tiny model (tokenmill/assets/tiny-model) from the Python standard library sources.

The model is a small ``transformers.LlamaForCausalLM`` trained from scratch with a plain PyTorch
loop and saved with ``save_pretrained``, so the result in ``tokenmill/assets/tiny-model/``
loads with ``transformers`` as well as with tokenmill.

Usage: ``python tools/train_default_model.py`` (about 35 minutes on a busy two-core CPU).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from corpus import VALIDATION_MODULUS, load_split, pack_stream, stream_windows
from measure_perplexity import TINY_MODEL_DIR, measure
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

EOS_TOKEN = "<|endoftext|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TOKEN = "<|end|>"
SPECIAL_TOKENS = [EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unsupported chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
SYSTEM_PROMPT = "You are a helpful assistant for Python programming."

# ---------------------------------------------------------------------------
# Chat examples
# ---------------------------------------------------------------------------


def render_chat(messages: list[dict[str, str]]) -> str:
    """Render messages exactly as ``CHAT_TEMPLATE`` does (without a generation prompt)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}{END_TOKEN}\n" for m in messages)


def documented_functions(source: str) -> list[tuple[str, str, str]]:
    """Return ``(name, code_without_docstring, docstring_summary)`` for documented functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2 or node.body[0].lineno == node.lineno:
            continue
        docstring, rest = node.body[0], node.body[1]
        if rest.lineno == docstring.end_lineno:
            continue
        header = lines[node.lineno - 1 : docstring.lineno - 1]
        body = lines[docstring.end_lineno : node.end_lineno]
        while body and not body[0].strip():
            body.pop(0)
        code = textwrap.dedent("\n".join(header + body))
        summary = " ".join(doc.split("\n\n")[0].split())
        if code[:1].isspace() or len(header) + len(body) > 40 or not 20 <= len(summary) <= 400:
            continue
        found.append((node.name, code, summary))
    return found


def chat_examples(train: dict[str, str]) -> list[str]:
    """Synthetic chat transcripts that explain or write stdlib functions."""
    examples = []
    for rel, source in train.items():
        for name, code, summary in documented_functions(source):
            key = hashlib.sha256(f"{rel}:{name}:{summary}".encode()).digest()
            if key[0] % 2 == 0:
                messages = [
                    {"role": "user", "content": f"Explain this function:\n\n{code}"},
                    {"role": "assistant", "content": summary},
                ]
            else:
                messages = [
                    {"role": "user", "content": f"Write a Python function `{name}`. {summary}"},
                    {"role": "assistant", "content": code},
                ]
            if key[1] % 4 == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
            examples.append(render_chat(messages))
    return examples


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose first ids are ``SPECIAL_TOKENS``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def tokenizer_config(max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` contents for ``transformers.AutoTokenizer``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "extra_special_tokens": SPECIAL_TOKENS[1:],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

# The default model's architecture, as ``transformers.LlamaConfig`` fields.
ARCHITECTURE: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 5,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
}


def build_model(special_ids: dict[str, int]) -> LlamaForCausalLM:
    """A freshly initialised float32 ``LlamaForCausalLM`` with ``ARCHITECTURE``.

    bos, eos and pad are ``EOS_TOKEN``; generation stops on ``EOS_TOKEN`` or ``END_TOKEN``. The pad id is set
    only after construction: ``transformers`` gives the embedding a zeroed, never-updated padding row, while
    ``EOS_TOKEN`` also separates the training documents and must be learned.
    """
    eos_id = special_ids[EOS_TOKEN]
    model = LlamaForCausalLM(LlamaConfig(**ARCHITECTURE, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None))
    model.config.pad_token_id = eos_id
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=[eos_id, special_ids[END_TOKEN]], pad_token_id=eos_id
    )
    return model


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation hyper-parameters."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    eval_every: int
    eval_windows: int
    seed: int


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warmup followed by cosine decay to ``min_lr_ratio * lr``."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    ratio = settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return settings.lr * ratio


def batches(windows: Tensor, batch_size: int, seed: int) -> Iterator[Tensor]:
    """Yield shuffled batches of windows forever; each epoch reshuffles deterministically."""
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(len(windows), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield windows[order[start : start + batch_size]]
        epoch += 1


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, windows: Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy over full-length windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        logits = model(batch[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def train(
    model: LlamaForCausalLM, train_windows: Tensor, val_windows: Tensor, settings: TrainSettings
) -> list[tuple[int, float, float]]:
    """Run AdamW training; return ``(step, train_loss, val_loss)`` at each evaluation."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    history = []
    data = batches(train_windows, settings.batch_size, settings.seed)
    progress = tqdm(range(settings.steps), desc="train", mininterval=10, ascii=True)
    running = None
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        batch = next(data)
        logits = model(batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        progress.set_postfix(loss=f"{running:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            val = mean_loss(model, val_windows[: settings.eval_windows], settings.batch_size)
            history.append((step + 1, running, val))
            tqdm.write(f"step {step + 1}: train loss {running:.4f}, val loss {val:.4f} (ppl {math.exp(val):.2f})")
    return history


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write pretty-printed JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def model_card(info: dict[str, Any]) -> str:
    """Render the model card README from collected training and evaluation facts."""
    config: LlamaConfig = info["config"]
    settings: TrainSettings = info["settings"]
    ids = info["special_ids"]
    heads = f"{config.num_attention_heads} / {config.num_key_value_heads}"
    history = "\n".join(f"| {step} | {tr:.3f} | {val:.3f} |" for step, tr, val in info["history"])
    return f"""# tokenmill tiny model

A small Llama-architecture causal language model that ships with tokenmill; the test suite
runs it when a test names no model (the default model is SmolLM2-135M-Instruct). It is
trained from scratch by `tools/train_default_model.py` on the Python standard library's own
source code, so it writes Python-looking text and follows a minimal chat format. It is a test
and demo model, not a useful assistant.

The folder uses the standard Hugging Face layout (`config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) and loads with
`transformers.AutoModelForCausalLM` / `AutoTokenizer` from the local path.

## Architecture

| | |
|---|---|
| architecture | `LlamaForCausalLM` (RMSNorm, rotary embeddings, SwiGLU, no biases) |
| parameters | {info["params"]:,} |
| `model.safetensors` | {info["file_bytes"]:,} bytes, float32 |
| hidden size / intermediate size | {config.hidden_size} / {config.intermediate_size} |
| layers | {config.num_hidden_layers} |
| attention heads / key-value heads | {heads} (grouped-query attention) |
| head dim | {config.head_dim} |
| vocabulary | {config.vocab_size} (byte-level BPE) |
| max position embeddings | {config.max_position_embeddings} (trained on {settings.seq_len}-token windows) |
| rope theta / rms norm eps | {config.rope_parameters["rope_theta"]} / {config.rms_norm_eps} |
| tied input/output embeddings | {str(config.tie_word_embeddings).lower()} |

## Training data

The `.py` files of the CPython {info["python_version"]} standard library (found via
`sysconfig.get_paths()["stdlib"]`), excluding `site-packages`, test suites (`test/`,
`tests/`), `idlelib`, `lib2to3`, `encodings`, `pydoc_data`, `turtledemo`, `ensurepip`
and generated `_sysconfigdata*` files. Files are read in sorted order; a file is held out
for validation when the first four bytes of the SHA-256 of its stdlib-relative path,
as an integer, are divisible by {VALIDATION_MODULUS}.
That gives {info["train_files"]} training files ({info["train_tokens"]:,} tokens) and
{info["val_files"]} validation files ({info["val_tokens"]:,} tokens).

{info["chat_examples"]:,} synthetic chat examples ({info["chat_tokens"]:,} tokens) are
mixed in: for documented functions in the training files the user either asks to explain
the function (source without its docstring) and the assistant answers with the
docstring's first paragraph, or asks for a function by name and summary and the assistant
answers with its source. A quarter of them start with a system message.

The source code is covered by the Python Software Foundation License
(https://docs.python.org/3/license.html), which applies to the training data.

## Tokenizer and chat format

Byte-level BPE trained with `tokenizers` on the training files (no prefix space; exact
round trip of code, whitespace and newlines). Special tokens:

| token | id | use |
|---|---|---|
| `{EOS_TOKEN}` | {ids[EOS_TOKEN]} | end of text, padding, document separator (also bos) |
| `{SYSTEM_TOKEN}` | {ids[SYSTEM_TOKEN]} | starts a system message |
| `{USER_TOKEN}` | {ids[USER_TOKEN]} | starts a user message |
| `{ASSISTANT_TOKEN}` | {ids[ASSISTANT_TOKEN]} | starts an assistant message |
| `{END_TOKEN}` | {ids[END_TOKEN]} | ends a message |

No token is added automatically when encoding. Each message is rendered as
`<|role|>\\n{{content}}<|end|>\\n` (roles `system`, `user`, `assistant`); the generation
prompt is `<|assistant|>\\n`. For example:

```text
<|system|>
{SYSTEM_PROMPT}<|end|>
<|user|>
Explain this function:

def double(x):
    return 2 * x<|end|>
<|assistant|>
```

`generation_config.json` stops on both `{EOS_TOKEN}` ({ids[EOS_TOKEN]}) and `{END_TOKEN}` ({ids[END_TOKEN]}).

## Training

A plain PyTorch loop over `transformers`' `LlamaForCausalLM`, float32 on CPU with
`torch.set_num_threads({info["threads"]})`, seed {settings.seed}: AdamW (betas 0.9/0.95,
weight decay {settings.weight_decay} on matrices), peak learning rate {settings.lr},
{settings.warmup_steps} warmup steps then cosine decay to {settings.min_lr_ratio:g}x,
gradient clipping {settings.grad_clip}, {settings.steps} steps of {settings.batch_size} x {settings.seq_len}
tokens ({info["tokens_seen"]:,} tokens, {info["epochs"]:.2f} epochs). Wall time:
{info["train_minutes"]:.1f} minutes of training, {info["total_minutes"]:.1f} minutes for the whole script.

| step | train loss | val loss (first {settings.eval_windows} windows) |
|---|---|---|
{history}

## Evaluation

Measured by `tools/measure_perplexity.py` with `transformers` on all held-out files
({info["eval"]["tokens"]:,} predicted tokens, non-overlapping {info["eval"]["seq_len"]}-token windows):

| | perplexity |
|---|---|
| this model | {info["eval"]["model_ppl"]:.2f} |
| unigram baseline (training-token frequencies, add-one smoothed) | {info["eval"]["unigram_ppl"]:.2f} |

## Regenerating

```bash
python tools/train_default_model.py      # trains and rewrites this folder
python tools/measure_perplexity.py       # re-measures the numbers above
```

Training is seeded and uses a deterministic data order, so a rerun on the same Python
version reproduces the model up to floating-point differences between machines.
"""


def parse_args() -> argparse.Namespace:
    """Command-line options; the defaults fit a ~40 minute budget on a shared two-core CPU."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=TINY_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=80)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--chat-fraction", type=float, default=0.15, help="share of training tokens from chat examples")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads; one is much faster when the CPU is shared"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    """Build corpus and tokenizer, train, write the model folder and its card."""
    args = parse_args()
    started = time.monotonic()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    train_texts, val_texts = load_split()
    print(f"corpus: {len(train_texts)} training files, {len(val_texts)} validation files")
    tokenizer = train_tokenizer(list(train_texts.values()), ARCHITECTURE["vocab_size"])
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    eos_id = ids[EOS_TOKEN]

    def encode(texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in tokenizer.encode_batch(texts)]

    code_docs = encode(list(train_texts.values()))
    val_docs = encode(list(val_texts.values()))
    code_tokens = sum(map(len, code_docs))
    chat_budget = int(code_tokens * args.chat_fraction / (1 - args.chat_fraction))
    candidates = [doc for doc in encode(chat_examples(train_texts)) if len(doc) < args.seq_len]
    random.Random(args.seed).shuffle(candidates)
    chat_docs: list[list[int]] = []
    chat_tokens = 0
    for doc in candidates:
        if chat_tokens + len(doc) > chat_budget:
            break
        chat_docs.append(doc)
        chat_tokens += len(doc)
    documents = code_docs + chat_docs
    random.Random(args.seed + 1).shuffle(documents)
    train_windows = torch.stack(stream_windows(pack_stream(documents, eos_id), args.seq_len, drop_last=True))
    val_windows = torch.stack(stream_windows(pack_stream(val_docs, eos_id), args.seq_len, drop_last=True))
    print(
        f"tokens: {code_tokens} code + {chat_tokens} chat ({len(chat_docs)} examples), "
        f"{len(train_windows)} training windows, {len(val_windows)} validation windows"
    )

    settings = TrainSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        min_lr_ratio=0.1,
        warmup_steps=args.warmup_steps,
        weight_decay=0.1,
        grad_clip=1.0,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        seed=args.seed,
    )
    model = build_model(ids)
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters")
    train_started = time.monotonic()
    history = train(model, train_windows, val_windows, settings)
    train_minutes = (time.monotonic() - train_started) / 60

    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)  # model.safetensors, config.json, generation_config.json
    tokenizer.save(str(output / "tokenizer.json"))
    write_json(output / "tokenizer_config.json", tokenizer_config(config.max_position_embeddings))

    evaluation = measure(output, args.seq_len)
    print(f"perplexity: model {evaluation['model_ppl']:.2f}, unigram baseline {evaluation['unigram_ppl']:.2f}")
    info = {
        "config": config,
        "settings": settings,
        "special_ids": ids,
        "params": params,
        "file_bytes": (output / "model.safetensors").stat().st_size,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "train_files": len(train_texts),
        "val_files": len(val_texts),
        "train_tokens": code_tokens,
        "val_tokens": sum(map(len, val_docs)),
        "chat_examples": len(chat_docs),
        "chat_tokens": chat_tokens,
        "threads": args.threads,
        "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "epochs": settings.steps * settings.batch_size / len(train_windows),
        "history": history,
        "train_minutes": train_minutes,
        "total_minutes": (time.monotonic() - started) / 60,
        "eval": evaluation,
    }
    (output / "README.md").write_text(model_card(info), encoding="utf-8")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
