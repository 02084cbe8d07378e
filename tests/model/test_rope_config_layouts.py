"""Both config.json layouts of RoPE parse to the same RopeConfig, for every supported rope type:
transformers 4's (``rope_theta`` + ``rope_scaling``) and transformers 5's (``rope_parameters``), the
latter both written by hand and as transformers itself converts the former."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import transformers

from tokenmill.model.config import ROPE_TYPES, ModelConfig, RopeConfig

THETA = 500000.0
BASE: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    original_max_position_embeddings=64,  # where a family (phi3) keeps it at the top level
)
# rope type -> its transformers-4 ``rope_scaling`` (non-default values everywhere, to see each one read)
SCALING: dict[str, dict[str, Any]] = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"type": "dynamic", "factor": 3.0},  # the older key name
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 6.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0] * 8},
}
CONFIG_CLASS = {"longrope": transformers.Phi3Config}  # the others: LlamaConfig


def parse(raw: dict[str, Any]) -> RopeConfig:
    return ModelConfig.from_dict(raw).rope


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_transformers_4_and_5_layouts_parse_to_the_same_rope(rope_type: str) -> None:
    assert rope_type in SCALING, f"add rope type {rope_type!r} to SCALING"
    scaling = SCALING[rope_type]
    v4 = {**BASE, "rope_theta": THETA, **({"rope_scaling": scaling} if scaling else {})}
    v5 = {**BASE, "rope_parameters": {"rope_type": rope_type, **scaling, "rope_theta": THETA}}
    converted = CONFIG_CLASS.get(rope_type, transformers.LlamaConfig)(**copy.deepcopy(v4)).to_dict()  # edits it
    assert "rope_scaling" not in converted and "rope_theta" not in converted  # transformers wrote the v5 layout
    assert converted["rope_parameters"]["rope_type"] == rope_type

    rope = parse(v4)
    assert parse(v5) == rope and parse(converted) == rope
    assert rope.rope_type == rope_type and rope.theta == THETA
    for name, value in scaling.items():
        if name not in ("type", "rope_type"):
            assert getattr(rope, name) == value, name
    if rope_type != "default":
        assert rope.original_max_position_embeddings == 64
    else:
        assert rope == RopeConfig(theta=THETA)
