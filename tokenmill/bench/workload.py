"""The default benchmark workload: a random ~100M-parameter Llama and random token prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=2048,
)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    meta: dict = field(default_factory=dict)

    @property
    def n_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def n_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_prompts: int = 64,
    prompt_range: tuple[int, int] = (32, 512),
    output_range: tuple[int, int] = (32, 256),
    vocab_size: int = 32000,
    seed: int = 0,
) -> Workload:
    """Prompt and output lengths uniform in the (inclusive) ranges; token ids uniform."""
    rng = random.Random(seed)
    lens = [rng.randint(*prompt_range) for _ in range(num_prompts)]
    outs = [rng.randint(*output_range) for _ in range(num_prompts)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lens]
    return Workload(
        prompts, outs, dict(num_prompts=num_prompts, prompt_range=prompt_range, output_range=output_range, seed=seed)
    )


def make_random_llama(path: Path, seed: int = 0, **overrides: int) -> Path:
    """Save a randomly initialized LlamaForCausalLM (fp32 safetensors) to ``path``; reuse if present."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    config = LlamaConfig(**{**DEFAULT_MODEL, **overrides}, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)
    return path
