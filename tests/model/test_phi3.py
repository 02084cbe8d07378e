"""Phi-3 beyond the shared parity cases (``test_parity.py``): longrope's short and long factors
chosen per request inside one ragged forward, a request crossing over during decode, and the
config conventions of transformers' ``Phi3Config``."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.generation.utils import GenerationMixin

from tests.model.test_parity import KVHarness, greedy_through_cache, hf_reference
from tests.tiny_models import BASE, save_tiny_model
from tokenmill.model.blocks import RotaryEmbedding
from tokenmill.model.config import ModelConfigError
from tokenmill.model.loader import load_model
from tokenmill.model.registry import load_model_config


def longrope(original: int, n_factors: int = 6, **extra: Any) -> dict[str, Any]:
    """Overrides for a tiny Phi-3 with partial rotary (0.75 of head_dim 16: 6 frequencies) and
    longrope switching at ``original`` tokens."""
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.25 * i for i in range(n_factors)],
        "long_factor": [1.0 + 3.0 * i for i in range(n_factors)],
    }
    return dict(partial_rotary_factor=0.75, original_max_position_embeddings=original, rope_scaling=scaling, **extra)


def prompts_of(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 97, (n,), generator=gen).tolist() for n in lengths]


def test_one_ragged_prefill_rotates_each_request_by_its_own_length(tmp_path: Path) -> None:
    hf_model = save_tiny_model(tmp_path, "phi3", **longrope(16))
    model = load_model(tmp_path, torch.float32, "cpu")
    prompts = prompts_of([5, 16, 17, 30])  # short, short (at the threshold), long, long
    harness = KVHarness(model)
    rows = [harness.pool.alloc() for _ in prompts]
    logits = torch.split(harness.extend(rows, prompts, [0] * len(prompts)), [len(p) for p in prompts])
    for prompt, ours in zip(prompts, logits):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-4


def test_short_and_long_requests_decode_together_like_generate(tmp_path: Path) -> None:
    # 5 + 23 decoded tokens stay within 32 (short factors throughout), 33 and 40 start long
    hf_model = save_tiny_model(tmp_path, "phi3", **longrope(32))
    model = load_model(tmp_path, torch.float32, "cpu")
    prompts = prompts_of([5, 33, 40])
    logits, tokens = greedy_through_cache(model, prompts)
    for prompt, ours_logits, ours_tokens in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_reference(hf_model, prompt)
        assert (ours_logits - ref_logits).abs().max().item() <= 1e-4
        assert ours_tokens == ref_tokens


def without_phi3_cache_reset(hf_model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """``hf_model`` generating with the generic input preparation, which keeps the cache when a
    request grows past original_max_position_embeddings (per-forward RoPE, as for Llama)."""
    hf_model.prepare_inputs_for_generation = types.MethodType(GenerationMixin.prepare_inputs_for_generation, hf_model)
    return hf_model


CROSSING_PROMPTS = [5, 12]
"""With original_max_position_embeddings 16, both grow past it within the 24 decoded tokens."""


def test_crossing_over_during_decode_keeps_the_cached_prefix(tmp_path: Path) -> None:
    """Tokens after the crossing use the long factors, the cached ones keep the short ones: what
    transformers computes per forward (and Phi-3's original implementation), not what
    ``Phi3ForCausalLM.generate`` does (next test)."""
    hf_model = without_phi3_cache_reset(save_tiny_model(tmp_path, "phi3", **longrope(16)))
    model = load_model(tmp_path, torch.float32, "cpu")
    prompts = prompts_of(CROSSING_PROMPTS)
    _, tokens = greedy_through_cache(model, prompts)
    assert tokens == [hf_reference(hf_model, prompt)[1] for prompt in prompts]


@pytest.mark.xfail(
    strict=True,
    reason="Phi3ForCausalLM.prepare_inputs_for_generation drops the cache when a request first grows past "
    "original_max_position_embeddings and recomputes it with the long factors; tokenmill keeps the cached prefix",
)
def test_crossing_over_during_decode_matches_phi3_generate(tmp_path: Path) -> None:
    hf_model = save_tiny_model(tmp_path, "phi3", **longrope(16))
    model = load_model(tmp_path, torch.float32, "cpu")
    prompts = prompts_of(CROSSING_PROMPTS)
    _, tokens = greedy_through_cache(model, prompts)
    assert tokens == [hf_reference(hf_model, prompt)[1] for prompt in prompts]


def write_config(path: Path, **fields: Any) -> dict[str, Any]:
    raw = {**BASE, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 8192, **fields}
    (path / "config.json").write_text(json.dumps(raw))
    return raw


FACTORS = {"short_factor": [1.0 + 0.5 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}


@pytest.mark.parametrize(
    "fields",
    [
        {"rope_scaling": {"type": "longrope", **FACTORS}},  # no original: Phi3Config's 4096
        {"rope_parameters": {"rope_type": "longrope", "original_max_position_embeddings": 64, **FACTORS}},  # ignored
        {"original_max_position_embeddings": 1024, "rope_scaling": {"type": "longrope", **FACTORS}},
        {"original_max_position_embeddings": 256, "rope_scaling": {"type": "longrope", "factor": 3.0, **FACTORS}},
        {
            "original_max_position_embeddings": 1024,
            "rope_scaling": {"type": "longrope", "attention_factor": 1.3, **FACTORS},
        },
        {"original_max_position_embeddings": 10000, "rope_scaling": {"type": "longrope", **FACTORS}},  # factor < 1
    ],
)
def test_longrope_config_conventions_match_transformers(tmp_path: Path, fields: dict[str, Any]) -> None:
    raw = write_config(tmp_path, **fields)
    config = load_model_config(tmp_path)
    ours = RotaryEmbedding(config.rotary_dim, config.rope, config.max_position_embeddings)
    hf_rotary = transformers.Phi3ForCausalLM(transformers.Phi3Config.from_dict(raw)).model.rotary_emb
    original = hf_rotary.config.rope_parameters["original_max_position_embeddings"]
    assert config.rope.original_max_position_embeddings == original
    x = torch.zeros(1, dtype=torch.float32)
    for length in (original, original + 1):  # the last short and the first long length
        positions = torch.arange(length - 3, length)
        ref_cos, ref_sin = hf_rotary(x, positions[None])
        cos, sin = ours(positions, torch.full_like(positions, length), torch.float32, length)
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_rope_types_outside_phi3config_are_refused(tmp_path: Path) -> None:
    write_config(tmp_path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="Phi3ForCausalLM supports rope types default, longrope; got 'linear'"):
        load_model_config(tmp_path)
