"""Qwen2 (``Qwen2ForCausalLM``): q/k/v always have biases, o_proj never does.

Qwen checkpoints keep a ``sliding_window`` value that applies only when ``use_sliding_window`` is
set (:func:`qwen_sliding_window`, shared with Qwen3 and Qwen3-MoE). Qwen2 and Qwen3 then slide only
in some layers (:func:`qwen_sliding_layers`); Qwen3-MoE in all of them, as in transformers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.model.blocks import SPLIT_PROJECTIONS, Attention, DecoderLayer, GatedMLP
from tokenmill.model.capabilities import FamilyCapabilities
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig, ModelConfigError

DEFAULT_MAX_WINDOW_LAYERS = 28
"""``Qwen2Config.max_window_layers`` (and Qwen3's) when config.json has none."""


def qwen_sliding_window(config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """``config`` without a sliding window unless config.json sets ``use_sliding_window``."""
    return config if raw.get("use_sliding_window", False) else dataclasses.replace(config, sliding_window=None)


def qwen_sliding_layers(config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """``config`` with the layers that slide, as transformers 5's Qwen2/Qwen3 configs choose them:
    config.json's ``layer_types`` ("sliding_attention" / "full_attention") when present, else the
    layers from ``max_window_layers`` on."""
    if config.sliding_window is None:
        return config
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = raw.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        return dataclasses.replace(config, sliding_window_layers=frozenset(range(first, config.num_layers)))
    if not isinstance(layer_types, list) or len(layer_types) != config.num_layers:
        raise ModelConfigError(f"config.json: 'layer_types' must list one type per layer, got {layer_types!r}")
    return dataclasses.replace(
        config, sliding_window_layers=frozenset(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    )


class Qwen2ForCausalLM(CausalLM):
    packed_modules = SPLIT_PROJECTIONS
    capabilities = FamilyCapabilities(tensor_parallel=True)

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        return qwen_sliding_layers(qwen_sliding_window(config, raw), raw)

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        attention = Attention(config, layer_id, qkv_bias=True, o_bias=False, qk_norm=False)
        return DecoderLayer(config, attention, GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias))
