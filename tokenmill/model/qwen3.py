"""Qwen3 (``Qwen3ForCausalLM``): per-head RMSNorm of q and k before RoPE; q/k/v and o share
``attention_bias``; Qwen's ``use_sliding_window`` and sliding-layer rules (see ``qwen2.py``)."""

from __future__ import annotations

from typing import Any

from tokenmill.model.blocks import SPLIT_PROJECTIONS, Attention, DecoderLayer, GatedMLP
from tokenmill.model.capabilities import FamilyCapabilities
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.qwen2 import qwen_sliding_layers, qwen_sliding_window


class Qwen3ForCausalLM(CausalLM):
    packed_modules = SPLIT_PROJECTIONS
    capabilities = FamilyCapabilities(tensor_parallel=True)

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        return qwen_sliding_layers(qwen_sliding_window(config, raw), raw)

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        bias = config.attention_bias
        attention = Attention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=True)
        return DecoderLayer(config, attention, GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias))
