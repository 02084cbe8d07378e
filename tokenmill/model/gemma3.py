"""Gemma 3 text (``Gemma3ForCausalLM``, config ``gemma3_text``): the Gemma layer (``gemma_blocks.py``)
with per-head Gemma RMSNorm of q and k before RoPE, five sliding-window ("local") layers to one
global one by default (``layer_types``, else ``sliding_window_pattern``, default 6), and a RoPE per
layer type: ``rope_parameters["full_attention"]`` / ``["sliding_attention"]`` (transformers 5), or
``rope_theta`` (default 1e6) with ``rope_scaling`` for the global layers and ``rope_local_base_freq``
(default 1e4) for the local ones (transformers 4 checkpoints). Final logits are soft-capped when
``final_logit_softcapping`` is set; ``attn_logit_softcapping`` is ignored, as transformers' Gemma 3
attention ignores it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.model.config import ModelConfig, ModelConfigError, RopeConfig, parse_rope
from tokenmill.model.gemma_blocks import GEMMA_ACTIVATION, GemmaCausalLM


class Gemma3ForCausalLM(GemmaCausalLM):
    qk_norm = True
    sliding_window_pattern = 6
    config_defaults = {
        "vocab_size": 262208,
        "head_dim": 256,
        "hidden_activation": GEMMA_ACTIVATION,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "eos_token_id": 1,
    }

    @classmethod
    def softcaps(cls, raw: dict[str, Any]) -> tuple[float | None, float | None]:
        return None, raw.get("final_logit_softcapping")

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        config = super().adjust_config(config, raw)
        full, sliding = layer_type_ropes({**cls.config_defaults, **raw})
        if sliding.partial_rotary_factor != 1:
            raise ModelConfigError(f"config.json: partial_rotary_factor != 1 is not supported for {cls.__name__}")
        return dataclasses.replace(config, rope=full, sliding_rope=sliding)


def layer_type_ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """The global and the local layers' RoPE, as ``Gemma3TextConfig.convert_rope_params_to_dict``
    reads them: nested ``rope_parameters`` when present (``rope_scaling`` then ignored), else
    ``rope_scaling`` applies to the global layers; missing thetas from ``rope_theta`` (1e6) and
    ``rope_local_base_freq`` (1e4)."""
    params = raw.get("rope_parameters")
    if params is None:
        params = {"full_attention": {"rope_type": "default", **(raw.get("rope_scaling") or {})}}
    if not isinstance(params, dict):
        raise ModelConfigError(f"config.json: 'rope_parameters' must be an object, got {params!r}")
    ropes = []
    for layer_type, theta in (
        ("full_attention", raw.get("rope_theta", 1_000_000.0)),
        ("sliding_attention", raw.get("rope_local_base_freq", 10_000.0)),
    ):
        layer_params = dict(params.get(layer_type) or {"rope_type": "default"})
        layer_params.setdefault("rope_theta", theta)
        if raw.get("partial_rotary_factor") is not None:
            layer_params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
        sub_raw = {"max_position_embeddings": raw.get("max_position_embeddings"), "rope_parameters": layer_params}
        ropes.append(parse_rope(sub_raw, f"config.json rope_parameters[{layer_type!r}]"))
    return ropes[0], ropes[1]
