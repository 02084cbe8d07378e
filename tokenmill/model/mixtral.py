"""Mixtral (``MixtralForCausalLM``): Mistral's attention, and a sparse MoE block in every layer
(``num_local_experts`` experts of ``intermediate_size``, top ``num_experts_per_tok`` renormalized,
routing weights kept in fp32). Checkpoint names: ``block_sparse_moe.gate``,
``block_sparse_moe.experts.<e>.w1`` (gate) / ``w3`` (up) / ``w2`` (down)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.model.blocks import SPLIT_PROJECTIONS, Attention, DecoderLayer
from tokenmill.model.capabilities import FamilyCapabilities
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.moe import ExpertNames, SparseMoE, parse_moe

MIXTRAL_EXPERT_NAMES = ExpertNames(gate="w1", up="w3", down="w2")


class MixtralForCausalLM(CausalLM):
    packed_modules = SPLIT_PROJECTIONS
    capabilities = FamilyCapabilities(tensor_parallel=True)
    checkpoint_module_names = {"mlp": "block_sparse_moe"}

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        moe = parse_moe(raw, "intermediate_size", True, frozenset(range(config.num_layers)))
        return dataclasses.replace(config, moe=moe)

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        assert config.moe is not None, "adjust_config sets the MoE settings"
        attention = Attention(config, layer_id, qkv_bias=False, o_bias=False, qk_norm=False)
        moe = SparseMoE(config.hidden_size, config.moe, MIXTRAL_EXPERT_NAMES, scores_in_input_dtype=False)
        return DecoderLayer(config, attention, moe)
