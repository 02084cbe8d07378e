"""Qwen2 (``Qwen2ForCausalLM``): q/k/v always have biases, o_proj never does.

Qwen checkpoints keep a ``sliding_window`` value that applies only when ``use_sliding_window`` is
set (:func:`qwen_sliding_window`, shared with Qwen3).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.model.blocks import SPLIT_PROJECTIONS, Attention, DecoderLayer, GatedMLP
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig


def qwen_sliding_window(config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """``config`` without a sliding window unless config.json sets ``use_sliding_window``."""
    return config if raw.get("use_sliding_window", False) else dataclasses.replace(config, sliding_window=None)


class Qwen2ForCausalLM(CausalLM):
    packed_modules = SPLIT_PROJECTIONS

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        return qwen_sliding_window(config, raw)

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        attention = Attention(config, layer_id, qkv_bias=True, o_bias=False, qk_norm=False)
        return DecoderLayer(config, attention, GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias))
