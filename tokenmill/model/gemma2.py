"""Gemma 2 (``Gemma2ForCausalLM``): the Gemma layer (``gemma_blocks.py``) without q/k norms, one
RoPE for every layer, sliding-window attention in the even layers (``layer_types``), and
soft-capping of the attention scores (``attn_logit_softcapping``, default 50) and of the final
logits (``final_logit_softcapping``, default 30); null in config.json turns either off.
The attention soft-cap needs a backend that implements it (torch; cpu; not triton).
"""

from __future__ import annotations

from tokenmill.model.gemma_blocks import GEMMA_ACTIVATION, GemmaCausalLM


class Gemma2ForCausalLM(GemmaCausalLM):
    sliding_window_pattern = 2
    config_defaults = {
        "vocab_size": 256000,
        "head_dim": 256,
        "hidden_activation": GEMMA_ACTIVATION,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "eos_token_id": 1,
    }
