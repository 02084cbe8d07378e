"""Llama and Mistral (``LlamaForCausalLM``, ``MistralForCausalLM``): the plain pre-norm decoder.

q/k/v and o share config.json's ``attention_bias``, the MLP its ``mlp_bias``. Mistral's
``sliding_window`` applies to every layer (``ModelConfig.layer_sliding_window``).
Opts in to the C++ decode forward: without biases and with fixed-frequency RoPE, a layer is
exactly its computation.
"""

from __future__ import annotations

from tokenmill.model.blocks import SPLIT_PROJECTIONS, Attention, DecoderLayer, GatedMLP
from tokenmill.model.capabilities import FamilyCapabilities
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig


class LlamaForCausalLM(CausalLM):
    packed_modules = SPLIT_PROJECTIONS
    capabilities = FamilyCapabilities(tensor_parallel=True, cpu_decode_forward=True)

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        bias = config.attention_bias
        attention = Attention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=False)
        return DecoderLayer(config, attention, GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias))
