"""Phi-3 (``Phi3ForCausalLM``: Phi-3, Phi-3.5, Phi-4-mini): the Llama layer without biases, whose
checkpoint stores q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``: the packed
modules load whole under their own names, so ``packed_modules`` is empty).

RoPE is "default" or "longrope", over the first ``partial_rotary_factor`` of each head (Phi-4-mini:
0.75). As in transformers' ``Phi3Config``, longrope's ``original_max_position_embeddings`` is the
top-level field, 4096 when absent (a value inside ``rope_parameters`` is overridden); the legacy
rope type names "su" and "yarn", which ``Phi3Config`` reads as "longrope", are refused.
``sliding_window`` is read as is, for every layer (as transformers' Phi-3 does).

Longrope picks the short or long factors per request by its length after each forward (see
``blocks.RotaryEmbedding``), which is what transformers' Phi-3 forward does. Where tokenmill does
not match ``Phi3ForCausalLM.generate``: when a request grows past ``original_max_position_embeddings``
while decoding, transformers drops its cache and recomputes the whole sequence with the long
factors (``prepare_inputs_for_generation``), while tokenmill keeps the cached keys and values
computed with the short ones and rotates only the new tokens with the long ones (what
transformers computes without that reset, and Phi-3's original implementation); and a prompt
longer than ``original_max_position_embeddings`` whose prefill is chunked, recomputed after
preemption or partly reused from the prefix cache has its earlier part rotated with the short
factors. Requests that stay on one side of the threshold, and prompts prefilled in one piece, match.
"""

from __future__ import annotations

from typing import Any

from tokenmill.model.blocks import Attention, DecoderLayer, GatedMLP
from tokenmill.model.capabilities import FamilyCapabilities
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig, ModelConfigError

DEFAULT_ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096
"""``Phi3Config.original_max_position_embeddings`` when config.json has none."""

ROPE_TYPES = ("default", "longrope")
"""The rope types ``Phi3Config`` accepts."""


class Phi3ForCausalLM(CausalLM):
    packed_modules = {}  # qkv_proj and gate_up_proj load whole, under their own names
    capabilities = FamilyCapabilities(partial_rotary=True)

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        if config.rope.rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"config.json: {cls.__name__} supports rope types {', '.join(ROPE_TYPES)}; "
                f"got {config.rope.rope_type!r}"
            )
        if config.rope.rope_type == "longrope" and "original_max_position_embeddings" not in raw:
            # the generic parse took rope_parameters' value (or max_position_embeddings); Phi3Config
            # ignores both for its default, which also sets the derived factor
            return ModelConfig.from_dict(
                {**raw, "original_max_position_embeddings": DEFAULT_ORIGINAL_MAX_POSITION_EMBEDDINGS}
            )
        return config

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        attention = Attention(config, layer_id, qkv_bias=False, o_bias=False, qk_norm=False)
        return DecoderLayer(config, attention, GatedMLP(config.hidden_size, config.intermediate_size, bias=False))
