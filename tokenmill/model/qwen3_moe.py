"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms), and a sparse MoE block
(``num_experts`` or ``num_local_experts`` experts of ``moe_intermediate_size``, top
``num_experts_per_tok``, renormalized when ``norm_topk_prob``, routing weights in the activations'
dtype) in every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``; the other layers
keep a dense MLP of ``intermediate_size``. Checkpoint names: ``mlp.gate``,
``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.model.blocks import SPLIT_PROJECTIONS, Attention, DecoderLayer, GatedMLP
from tokenmill.model.capabilities import FamilyCapabilities
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig, ModelConfigError
from tokenmill.model.moe import ExpertNames, SparseMoE, parse_moe
from tokenmill.model.qwen2 import qwen_sliding_window

QWEN_EXPERT_NAMES = ExpertNames(gate="gate_proj", up="up_proj", down="down_proj")


class Qwen3MoeForCausalLM(CausalLM):
    packed_modules = SPLIT_PROJECTIONS
    capabilities = FamilyCapabilities(tensor_parallel=True)

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        step = raw.get("decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise ModelConfigError(f"config.json: 'decoder_sparse_step' must be a positive integer, got {step!r}")
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ModelConfigError(f"config.json: 'mlp_only_layers' must be a list of layer indices, got {dense!r}")
        sparse = frozenset(i for i in range(config.num_layers) if i not in dense and (i + 1) % step == 0)
        moe = parse_moe(raw, "moe_intermediate_size", bool(raw.get("norm_topk_prob")), sparse)
        return qwen_sliding_window(dataclasses.replace(config, moe=moe), raw)

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        assert config.moe is not None, "adjust_config sets the MoE settings"
        bias = config.attention_bias
        attention = Attention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=True)
        if layer_id in config.moe.sparse_layers:
            mlp = SparseMoE(config.hidden_size, config.moe, QWEN_EXPERT_NAMES, scores_in_input_dtype=True)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        return DecoderLayer(config, attention, mlp)
