"""A tiny Phi-3 through the whole engine (``LLM``): batched, chunked prefill, both CPU attention
backends, greedy tokens equal to transformers' ``generate``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.model.test_phi3 import longrope
from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, SamplingParams

BACKENDS = ["cpu", "torch"]


def checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp(name)
    hf_model = save_tiny_checkpoint(path, "phi3", max_position_embeddings=512, **overrides)
    hf_model.generation_config.eos_token_id = None
    return path, hf_model


@pytest.fixture(scope="module")
def partial_rotary(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return checkpoint(tmp_path_factory, "phi3-partial", partial_rotary_factor=0.75, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def long_rope(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return checkpoint(tmp_path_factory, "phi3-longrope", **longrope(32))


def prompts_of(lengths: list[int]) -> list[list[int]]:
    """Random prompts with distinct first tokens (no prefix shared through the prefix cache)."""
    rng = random.Random(0)
    firsts = rng.sample(range(4, 97), len(lengths))
    return [[first] + [rng.randrange(4, 97) for _ in range(n - 1)] for first, n in zip(firsts, lengths)]


def run(
    path: Path, backend: str, prompts: list[list[int]], max_tokens: list[int], budget: int, kv_slots: int = 1024
) -> tuple[list, dict]:
    llm = LLM(
        dtype="float32",
        model=str(path),
        attention_backend=backend,
        num_kv_slots=kv_slots,
        max_num_batched_tokens=budget,
    )
    try:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.stats()["scheduler"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_rotary_chunked_and_preempted_batch_matches_transformers(partial_rotary, backend: str) -> None:
    path, hf_model = partial_rotary
    prompts = prompts_of([3, 70, 25, 41, 9, 55])
    max_tokens = [16, 8, 20, 12, 24, 10]
    ours, stats = run(path, backend, prompts, max_tokens, budget=16, kv_slots=96)  # 293 tokens in all
    assert stats["chunked_prefills"] > 0 and stats["preemptions"] > 0
    assert ours == [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_short_and_long_requests_in_one_batch_match_transformers(long_rope, backend: str) -> None:
    """Requests within original_max_position_embeddings (32) to the end use the short factors, the
    others the long ones, side by side in every step. Each prompt is prefilled in one piece and none
    crosses over while decoding: where tokenmill can match transformers (see ``blocks.RotaryEmbedding``)."""
    path, hf_model = long_rope
    prompts = prompts_of([4, 40, 9, 20, 47])
    max_tokens = [16, 16, 20, 12, 10]
    ours, stats = run(path, backend, prompts, max_tokens, budget=128)
    assert stats["chunked_prefills"] == 0
    assert ours == [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_short_requests_chunked_match_transformers(long_rope, backend: str) -> None:
    path, hf_model = long_rope
    prompts = prompts_of([12, 30, 21])
    max_tokens = [20, 3, 12]  # each ends within 32 tokens: short factors throughout
    ours, stats = run(path, backend, prompts, max_tokens, budget=8)
    assert stats["chunked_prefills"] > 0
    assert ours == [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]
