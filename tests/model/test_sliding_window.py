"""Sliding-window models through the engine against transformers: greedy tokens of prompts several
times the window, with chunked prefill whose chunks start past the window of their first row,
the one-token rows of mixed steps, and prompts that reuse cached prefixes (prefix caching on);
attention backends "torch" and "cpu". Single-step parity of the model itself is in test_parity.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.model.test_parity import greedy_through_cache, hf_reference
from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import load_model

NEW_TOKENS = 24
PROMPT_LENS = [30, 45, 70]

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler for the CPU kernels")


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    """A checkpoint with small windows (qwen2: only its upper layer slides), its prompts and
    transformers' greedy continuations of them."""
    path = tmp_path_factory.mktemp(f"window-{request.param}")
    if request.param == "mistral":
        hf_model = save_tiny_checkpoint(path, "mistral", sliding_window=8)
    else:
        hf_model = save_tiny_checkpoint(path, "qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts.append(prompts[2][:50] + prompts[0][:10])  # shares 50 tokens with the third prompt
    return path, prompts, [hf_reference(hf_model, p)[1] for p in prompts]


def test_chunked_prefill_across_the_window_matches_transformers(windowed: tuple) -> None:
    path, prompts, expected = windowed
    model = load_model(path, torch.float32, "cpu")
    for chunk in (5, 20):  # the second chunk's rows see the first chunk only within their window
        _, tokens = greedy_through_cache(model, prompts, chunk=chunk)
        assert tokens == expected


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_compiler)])
def test_engine_matches_transformers(windowed: tuple, backend: str) -> None:
    path, prompts, expected = windowed
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cpu",
        attention_backend=backend,
        page_size=4,
        num_kv_slots=160,  # less than the requests need at once: preemption
        max_running_requests=4,
        max_num_batched_tokens=36,  # chunks of up to 36 rows: the cpu backend's fused-softmax path too
        enable_prefix_caching=True,
    )
    try:
        assert llm.engine.max_context_len == 256  # the model's positions, not its window
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # cached prefixes
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats["cache"]["prefix_hit_tokens"] > 0
    assert stats["scheduler"]["preemptions"] > 0
    assert stats["scheduler"]["mixed_steps"] > 0
    assert first == expected
    assert again == expected
