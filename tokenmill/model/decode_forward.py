"""The forward of a pure decode step as one C++ call (``kernels/cpu/decode_forward.cpp``).

Eligible: a decode view on the "cpu" attention backend, fp32 CPU weights, at most
``PANEL_MAX_ROWS`` requests, and a model whose layers have no projection biases and no q/k
norms, with fixed-frequency RoPE (Llama, Mistral; not Qwen2's qkv bias, Qwen3's q/k norms or
dynamic NTK scaling). The kernels and their order are those of the Python forward, so the logits
are the same; what goes away is ~10 Python-level op calls per layer (~4 ms of a ~33 ms batch-1
forward of the ~100M benchmark model on 2 cores) and ~8 around the layers: embedding, cos/sin
rows, final norm, LM head (~0.5 ms: the step's weight stream evicts their code each time).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from tokenmill.cache.views import DecodeKVCache, KVView
from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.linear import PANEL_MAX_ROWS, SKINNY_MAX_ROWS

if TYPE_CHECKING:
    from tokenmill.model.transformer import CausalLM


def decode_forward(
    model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_view: KVView
) -> torch.Tensor | None:
    """The logits ``[B, vocab]`` of a pure decode step (every row samples), with its keys and
    values stored; None when the step is not eligible, and nothing was done."""
    config = model.config
    embed = model.model.embed_tokens.weight
    if not (
        isinstance(kv_view, DecodeKVCache)
        and model.backend is not None
        and model.backend.name == "cpu"
        and embed.is_cpu
        and embed.dtype == torch.float32
        and input_ids.shape[0] <= PANEL_MAX_ROWS
        and not (config.attention_bias or config.mlp_bias or config.qk_norm or model.rotary.is_dynamic)
    ):
        return None
    ops = load_cpu_kernels()
    if ops is None:
        return None
    cos_table, sin_table = model.rotary.table(kv_view.max_seq_len, embed.dtype, embed.device)
    return ops.decode_forward(
        input_ids, positions, embed, cos_table, sin_table, _layer_weights(model), model.model.norm.weight,
        model.lm_head_weight, kv_view.k_buffer, kv_view.v_buffer, kv_view.out_cache_loc, kv_view.req_to_token,
        kv_view.req_pool_indices.contiguous(), kv_view.seq_lens.contiguous(),
        config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps, model.backend.scale,
        SKINNY_MAX_ROWS,
    )


_WEIGHTS: weakref.WeakKeyDictionary[CausalLM, list[torch.nn.Parameter]] = weakref.WeakKeyDictionary()


def _layer_weights(model: CausalLM) -> list[torch.nn.Parameter]:
    """The six weights of each layer in ``decode_forward.cpp``'s order, gathered once per model
    (~0.5 ms of nn.Module attribute lookups per step otherwise). The Parameter objects are kept:
    weight updates copy into them and ``Module.to`` swaps their ``.data``, so they stay current."""
    weights = _WEIGHTS.get(model)
    if weights is None:
        weights = _WEIGHTS[model] = [
            w
            for layer in model.model.layers
            for w in (
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj.weight,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight,
                layer.mlp.down_proj.weight,
            )
        ]
    return weights
