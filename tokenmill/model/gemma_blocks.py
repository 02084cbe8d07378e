"""What Gemma 2 and Gemma 3 share (``gemma2.py``, ``gemma3.py``), as transformers computes it.

- :class:`GemmaRMSNorm`: ``x / rms(x) * (1 + w)``, all in fp32, rounded once to the input dtype
  (Llama's norm rounds before multiplying by ``w``); its checkpoint weight is ``w`` (zero: identity).
- :class:`GemmaDecoderLayer`: four norms per layer, each sublayer's output normed before its
  residual sum: ``h += post_attn_norm(attn(input_norm(h)))``, ``h += post_ff_norm(mlp(pre_ff_norm(h)))``.
- :class:`GemmaCausalLM`: embeddings times ``sqrt(hidden_size)`` (the factor rounded to the
  activation dtype first), GeGLU MLP (``hidden_activation`` ``gelu_pytorch_tanh``), softmax scale
  ``query_pre_attn_scalar ** -0.5``, sliding-window layers per ``layer_types`` (default: every layer
  but each ``pattern``-th), the config defaults of transformers' config class where config.json omits
  a field, and the family's soft-capping (see :meth:`GemmaCausalLM.softcaps`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.model.blocks import SPLIT_PROJECTIONS, Attention, GatedMLP, RMSNorm
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig, ModelConfigError

GEMMA_ACTIVATION = "gelu_pytorch_tanh"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with the ``(1 + w)`` weight convention, computed in fp32 (transformers' ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; ``residual`` is not modified."""
        residual = residual + x
        return self(residual), residual


class GemmaDecoderLayer(nn.Module):
    """Gemma's sandwich layer: input, post-attention, pre-feedforward and post-feedforward norms."""

    def __init__(self, config: ModelConfig, self_attn: Attention, mlp: GatedMLP) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        plan: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DecoderLayer``'s contract: input ``h + residual`` (``h`` alone for the first layer),
        output ``(post_ff_norm(mlp_out), residual)``, the sum left to the next norm."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        attn = self.post_attention_layernorm(self.self_attn(x, cos, sin, backend, plan))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaCausalLM(CausalLM):
    """The Gemma 2 / Gemma 3 text model; a family sets ``qk_norm``, ``config_defaults``,
    ``sliding_window_pattern`` and may extend :meth:`adjust_config`."""

    packed_modules = SPLIT_PROJECTIONS
    activations = (GEMMA_ACTIVATION,)
    norm_class = GemmaRMSNorm
    qk_norm: ClassVar[bool] = False
    config_defaults: ClassVar[dict[str, Any]] = {}
    """transformers' config-class defaults of the fields the generic parse reads differently."""
    sliding_window_pattern: ClassVar[int] = 2
    """Without ``layer_types``, layer ``i`` slides unless ``(i + 1) % pattern == 0``."""

    @classmethod
    def softcaps(cls, raw: dict[str, Any]) -> tuple[float | None, float | None]:
        """(attention logit, final logit) soft-caps of config.json ``raw`` (with the defaults applied)."""
        return raw.get("attn_logit_softcapping"), raw.get("final_logit_softcapping")

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        raw = {**cls.config_defaults, **raw}
        if raw.get("use_bidirectional_attention"):
            raise ModelConfigError(f"config.json: use_bidirectional_attention is not supported for {cls.__name__}")
        config = ModelConfig.from_dict(raw)
        attn_cap, final_cap = cls.softcaps(raw)
        config = dataclasses.replace(
            config,
            hidden_act=str(raw.get("hidden_activation") or GEMMA_ACTIVATION),
            attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
            attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
            final_logit_softcapping=None if final_cap is None else float(final_cap),
        )
        return cls._sliding_layers(config, raw)

    @classmethod
    def _sliding_layers(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        """The layers whose ``layer_types`` entry is "sliding_attention" slide (transformers' default
        types when absent); a model with such layers needs a ``sliding_window``."""
        layer_types = raw.get("layer_types")
        if layer_types is None:
            pattern = raw.get("sliding_window_pattern", cls.sliding_window_pattern)
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_layers)
            ]
        if not isinstance(layer_types, list) or len(layer_types) != config.num_layers:
            raise ModelConfigError(f"config.json: 'layer_types' must list one type per layer, got {layer_types!r}")
        sliding = frozenset(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        if sliding and config.sliding_window is None:
            raise ModelConfigError("config.json: 'layer_types' has sliding_attention layers but no 'sliding_window'")
        return dataclasses.replace(config, sliding_window_layers=sliding)

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> GemmaDecoderLayer:
        bias = config.attention_bias
        attention = Attention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm, norm=GemmaRMSNorm)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=False, activation=config.hidden_act)
        return GemmaDecoderLayer(config, attention, mlp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times ``sqrt(hidden_size)`` rounded to their dtype (as transformers does)."""
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(self.config.hidden_size**0.5).to(h.dtype)
