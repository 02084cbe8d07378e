"""Train tokenmill's bundled default model from the Python standard library sources.

The model is a small Llama-architecture causal LM written here in plain PyTorch with the
exact numerics and weight names of Hugging Face's ``LlamaForCausalLM``, so the result in
``tokenmill/assets/default-model/`` loads with ``transformers`` as well as with tokenmill.

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
import sysconfig
import textwrap
import time
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor, nn
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "tokenmill" / "assets" / "default-model"

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

EXCLUDED_DIRS = frozenset(
    {
        "__phello__",
        "encodings",
        "ensurepip",
        "idlelib",
        "lib2to3",
        "pydoc_data",
        "site-packages",
        "test",
        "tests",
        "turtledemo",
    }
)
VALIDATION_MODULUS = 20  # one file in twenty (~5%) is held out for validation


# ---------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------


def stdlib_root() -> Path:
    """Directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[str]:
    """Sorted relative paths of the stdlib ``.py`` files used as the corpus."""
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = rel.parts[:-1]
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in parts):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def is_validation_file(rel_path: str) -> bool:
    """Deterministic held-out split keyed on the file's path relative to the stdlib root."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % VALIDATION_MODULUS == 0


def read_source(path: Path) -> str | None:
    """Read a Python source file honouring its encoding cookie; ``None`` if unreadable."""
    try:
        with tokenize.open(path) as handle:
            return handle.read()
    except (SyntaxError, UnicodeDecodeError):
        return None


def load_split(root: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Return ``(train, validation)`` mappings of relative path to source text."""
    root = root or stdlib_root()
    train: dict[str, str] = {}
    validation: dict[str, str] = {}
    for rel in corpus_files(root):
        text = read_source(root / rel)
        if text and text.strip():
            (validation if is_validation_file(rel) else train)[rel] = text
    return train, validation


def pack_stream(documents: list[list[int]], eos_id: int) -> Tensor:
    """Concatenate token documents into one stream, each preceded by the EOS separator."""
    stream: list[int] = []
    for doc in documents:
        stream.append(eos_id)
        stream.extend(doc)
    return torch.tensor(stream, dtype=torch.long)


def stream_windows(stream: Tensor, seq_len: int, drop_last: bool) -> list[Tensor]:
    """Split a stream into windows of ``seq_len + 1`` tokens overlapping by one token.

    Every token after the first is a prediction target exactly once; with ``drop_last``
    a final shorter window is discarded.
    """
    windows = []
    for start in range(0, len(stream) - 1, seq_len):
        window = stream[start : start + seq_len + 1]
        if len(window) == seq_len + 1 or not drop_last:
            windows.append(window)
    return windows


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


def tokenizer_config(max_length: int) -> dict:
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
# Model (Hugging Face Llama numerics and parameter names)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters, named as in Hugging Face's ``LlamaConfig``."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 5
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary_tables(config: LlamaConfig, seq_len: int) -> tuple[Tensor, Tensor]:
    """Cos/sin tables of shape ``(seq_len, head_dim)`` with the two halves concatenated."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    """Map ``[x1, x2]`` to ``[-x2, x1]`` along the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, kv_dim = config.hidden_size, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder stack and final norm (the ``model.`` prefix in HF checkpoints)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama decoder with a language-modelling head; parameter names match HF exactly."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=config.initializer_range)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        cos, sin = rotary_tables(self.config, input_ids.shape[1])
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def checkpoint(self) -> dict[str, Tensor]:
        """State dict in HF layout (``lm_head.weight`` omitted when tied)."""
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            del state["lm_head.weight"]
        return {name: tensor.detach().contiguous() for name, tensor in state.items()}


def hf_config(config: LlamaConfig, eos_id: int) -> dict:
    """``config.json`` contents for ``transformers.LlamaForCausalLM``."""
    fields = asdict(config)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **fields,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


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


def batches(windows: Tensor, batch_size: int, seed: int):
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
        logits = model(batch[:, :-1])
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
        logits = model(batch[:, :-1])
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


def write_json(path: Path, data: dict) -> None:
    """Write pretty-printed JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def model_card(info: dict) -> str:
    """Render the model card README from collected training and evaluation facts."""
    config: LlamaConfig = info["config"]
    settings: TrainSettings = info["settings"]
    ids = info["special_ids"]
    history = "\n".join(f"| {step} | {tr:.3f} | {val:.3f} |" for step, tr, val in info["history"])
    return f"""# tokenmill default model

A small Llama-architecture causal language model that ships with tokenmill and is used
when no `--model` is given. It is trained from scratch by `tools/train_default_model.py`
on the Python standard library's own source code, so it writes Python-looking text and
follows a minimal chat format. It is a test and demo model, not a useful assistant.

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
| attention heads / key-value heads | {config.num_attention_heads} / {config.num_key_value_heads} (grouped-query attention) |
| head dim | {config.head_dim} |
| vocabulary | {config.vocab_size} (byte-level BPE) |
| max position embeddings | {config.max_position_embeddings} (trained on {settings.seq_len}-token windows) |
| rope theta / rms norm eps | {config.rope_theta} / {config.rms_norm_eps} |
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

Plain PyTorch, float32 on CPU with `torch.set_num_threads({info["threads"]})`, seed {settings.seed}: AdamW
(betas 0.9/0.95, weight decay {settings.weight_decay} on matrices), peak learning rate
{settings.lr}, {settings.warmup_steps} warmup steps then cosine decay to
{settings.min_lr_ratio:g}x, gradient clipping {settings.grad_clip}, {settings.steps} steps of
{settings.batch_size} x {settings.seq_len} tokens ({info["tokens_seen"]:,} tokens,
{info["epochs"]:.2f} epochs). Wall time: {info["train_minutes"]:.1f} minutes of training,
{info["total_minutes"]:.1f} minutes for the whole script.

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
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
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
    config = LlamaConfig()

    train_texts, val_texts = load_split()
    print(f"corpus: {len(train_texts)} training files, {len(val_texts)} validation files")
    tokenizer = train_tokenizer(list(train_texts.values()), config.vocab_size)
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
    print(f"tokens: {code_tokens} code + {chat_tokens} chat ({len(chat_docs)} examples), "
          f"{len(train_windows)} training windows, {len(val_windows)} validation windows")

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
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters")
    train_started = time.monotonic()
    history = train(model, train_windows, val_windows, settings)
    train_minutes = (time.monotonic() - train_started) / 60

    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    save_file(model.checkpoint(), output / "model.safetensors", metadata={"format": "pt"})
    write_json(output / "config.json", hf_config(config, eos_id))
    write_json(
        output / "generation_config.json",
        {"bos_token_id": eos_id, "eos_token_id": [eos_id, ids[END_TOKEN]], "pad_token_id": eos_id},
    )
    tokenizer.save(str(output / "tokenizer.json"))
    write_json(output / "tokenizer_config.json", tokenizer_config(config.max_position_embeddings))

    from measure_perplexity import measure  # imported late: it imports this module

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
