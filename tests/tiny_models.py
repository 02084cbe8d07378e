"""Tiny random checkpoints of each supported architecture, saved with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

BASE: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.08,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "phi3": transformers.Phi3Config,
    "mixtral": transformers.MixtralConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "gemma2": transformers.Gemma2Config,  # head_dim defaults to 256: tests set it
    "gemma3": transformers.Gemma3TextConfig,
}

MODEL_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
}


RANDOM_NORM_KINDS = {"gemma2", "gemma3"}
"""Kinds whose norm weights are randomized (transformers initializes Gemma's ``(1 + w)`` norms to
w = 0, which would leave the convention untested)."""


def make_hf_model(kind: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A seeded random model of architecture ``kind`` with ``BASE`` settings plus overrides."""
    config = CONFIG_CLASSES[kind](**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = MODEL_CLASSES[kind](config).float().eval()
    if kind in RANDOM_NORM_KINDS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    return model


def save_tiny_model(
    path: Path, kind: str, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> transformers.PreTrainedModel:
    """Build a tiny model, save it to ``path`` (safetensors), and return the HF model."""
    model = make_hf_model(kind, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model


def save_tiny_checkpoint(
    path: Path, kind: str = "llama", seed: int = 0, **overrides: Any
) -> transformers.PreTrainedModel:
    """A complete checkpoint folder: tiny random model plus the tiny word-level tokenizer."""
    from tests.tiny_tokenizer import save_tiny_tokenizer

    model = save_tiny_model(path, kind, seed, **overrides)
    save_tiny_tokenizer(path, vocab_size=model.config.vocab_size)
    return model


def hf_greedy(hf_model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (``max_tokens`` new tokens): the oracle."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()
