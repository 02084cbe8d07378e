"""The benchmark workloads: random token prompts, and random models of three shapes (presets): a
~100M-parameter Llama (the default), a Mixtral of ~100M active parameters per token, and a Llama of
SmolLM2-135M's shape (30 thin layers: many small products per token, the batch-1 decode case)."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.own_thread import on_own_thread

DEFAULT_MODEL = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=2048,
)
MOE_MODEL = dict(
    DEFAULT_MODEL,
    intermediate_size=1024,  # per expert: 2 of 8 active, ~100M active weights per token (LM head included)
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=None,
)
SMOLLM2_135M_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
)
PRESETS = {
    "llama": ("LlamaForCausalLM", DEFAULT_MODEL),
    "mixtral": ("MixtralForCausalLM", MOE_MODEL),
    "smollm2-135m-shape": ("LlamaForCausalLM", SMOLLM2_135M_SHAPE),
}
"""Preset name -> (transformers class, config values) of the random benchmark models."""
WORKLOAD_HELP = {
    "prompt": "each prompt's length in tokens, uniform in [MIN, MAX] (default: %(default)s)",
    "output": "each request's output length in tokens, uniform in [MIN, MAX] (default: %(default)s)",
    "seed": "seed of the workload: the same seed draws the same prompts and lengths (default: %(default)s)",
}
"""argparse help of the workload options every ``tokenmill bench`` command takes (:func:`make_workload`)."""


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


COPY_HEAVY_SNIPPETS = (
    """def moving_average(values, window):
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
""",
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
""",
    """def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config
""",
    """def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged
""",
    """def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
""",
    """class Stack:
    def __init__(self):
        self.values = []

    def push(self, value):
        self.values.append(value)

    def pop(self):
        if not self.values:
            raise IndexError("pop from an empty stack")
        return self.values.pop()

    def peek(self):
        return self.values[-1]
""",
    """def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: item[1], reverse=True)
""",
    """def read_scores(path):
    scores = []
    with open(path) as handle:
        for line in handle:
            name, score = line.rstrip().split(",")
            scores.append((name, int(score)))
    return scores
""",
)

COPY_HEAVY_CHANGES = (  # three one-change edits per snippet, in COPY_HEAVY_SNIPPETS' order
    (
        "Add a docstring to the function.",
        "Rename the variable total to running_sum.",
        "Add type hints to the function.",
    ),
    ("Add type hints to every method.", "Rename the method total to count_all.", "Add a docstring to the class."),
    ("Rename the variable config to settings.", "Add type hints to the function.", "Add a docstring to the function."),
    ("Add a comment above the while loop.", "Rename the variable merged to result.", "Add type hints to the function."),
    (
        "Rename the function binary_search to find_index.",
        "Add type hints to the function.",
        "Add a docstring to the function.",
    ),
    ("Add type hints to every method.", "Rename the list values to items.", "Add a docstring to the class."),
    (
        "Rename the variable counts to frequencies.",
        "Add type hints to the function.",
        "Add a docstring to the function.",
    ),
    ("Rename the variable handle to file.", "Add type hints to the function.", "Add a docstring to the function."),
)


def copy_heavy_messages() -> list[list[dict[str, str]]]:
    """Chat requests whose answers are meant to repeat most of the prompt ("rewrite this code with one
    change"): the case prompt lookup speeds up. The first edit of each snippet first, then the
    second ones, then the third (so a prefix of the list covers different snippets)."""
    return [
        [{"role": "user", "content": f"{changes[round_]} Reply with the whole code only.\n\n```python\n{code}```"}]
        for round_ in range(3)
        for code, changes in zip(COPY_HEAVY_SNIPPETS, COPY_HEAVY_CHANGES)
    ]


def bench_model_path(preset: str = "llama") -> Path:
    """Where the preset's random model is kept between runs (the system's temporary folder)."""
    return Path(tempfile.gettempdir()) / f"tokenmill-bench-{preset}"


@on_own_thread
def make_random_model(path: Path | None = None, preset: str = "llama", seed: int = 0) -> Path:
    """Save a randomly initialized model of ``preset`` (fp32 safetensors, untied LM head) to ``path``
    (default :func:`bench_model_path`); reuse it if present. Runs on a thread of its own."""
    import torch
    import transformers

    path = Path(path) if path is not None else bench_model_path(preset)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    class_name, values = PRESETS[preset]
    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**values, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config).float()
    model.save_pretrained(path, safe_serialization=True)
    return path
