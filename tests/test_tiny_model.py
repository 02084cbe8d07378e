"""The tiny model (what the test suite runs when it names no model): loads offline in transformers,
tokenmill's greedy output equals transformers', and its completions of Python prompts look more like Python
than random tokens."""

from __future__ import annotations

import keyword
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.default_model import TINY_MODEL_DIR

PROMPTS = ["def fibonacci(", "import os\n\n\ndef ", "class Stack:\n    def __init__(self", "for i in range("]
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(dtype="float32", num_kv_slots=8192)  # no model: $TOKENMILL_DEFAULT_MODEL, the tiny model
    yield engine
    engine.shutdown()


def test_the_tests_default_is_the_tiny_model(llm: LLM) -> None:
    assert llm.engine.config.model_path() == TINY_MODEL_DIR
    assert (TINY_MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 1024**2


def test_greedy_continuations_equal_transformers(llm: LLM) -> None:
    hf_tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, local_files_only=True, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = torch.tensor([hf_tok.encode(prompt)])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0
            )[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == ref


def _python_word_rate(text: str) -> float:
    """Fraction of identifier-like words that are Python keywords or builtins."""
    words = WORD.findall(text)
    python_words = set(keyword.kwlist) | set(dir(__builtins__)) | {"self", "cls"}
    return sum(w in python_words for w in words) / max(1, len(words))


def test_completions_look_more_like_python_than_random_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    tokenizer = llm.engine.tokenizer
    rng = random.Random(0)
    random_texts = [tokenizer.decode([rng.randrange(5, tokenizer.vocab_size) for _ in range(64)]) for _ in PROMPTS]
    model_rate = sum(map(_python_word_rate, texts)) / len(texts)
    random_rate = sum(map(_python_word_rate, random_texts)) / len(random_texts)
    assert model_rate > 2 * random_rate + 0.05, (texts, model_rate, random_rate)
    assert sum("(" in t or ":" in t or "=" in t for t in texts) >= 3
