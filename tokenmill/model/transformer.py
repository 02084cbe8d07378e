"""Decoder-only transformer over a flat ragged token layout.

``forward(input_ids, positions, kv_view, logits_indices)``: ``input_ids`` and ``positions`` are
1-D over every token of every request in the step; only the rows in ``logits_indices`` are
projected through the LM head. Parameter names follow Hugging Face's except for the fused
projections; :meth:`CausalLM.checkpoint_targets` maps every checkpoint name to where it lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.cache.views import DecodeKVCache, KVView
from tokenmill.model.config import ModelConfig
from tokenmill.model.decode_forward import decode_forward
from tokenmill.model.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from tokenmill.kernels.linear import Linear, linear


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor lives: rows ``[row_start, row_start + n_rows)`` of ``param``."""

    param_name: str
    row_start: int
    n_rows: int


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        kv_view: KVView,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried unsummed: the layer's input is ``h + residual`` (``h`` alone
        for the first layer), its output ``(mlp_out, residual)``; each sum is fused into the next norm."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(
            self.self_attn(x, cos, sin, backend, kv_view), residual
        )
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """``model.*`` in checkpoint names: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.backend: AttentionBackend | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_view: KVView,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (all rows when ``logits_indices`` is None)."""
        if self.backend is None:
            raise RuntimeError("CausalLM.backend must be set before forward")
        if logits_indices is None:
            logits = decode_forward(self, input_ids, positions, kv_view)  # one C++ call, where eligible
            if logits is not None:
                return logits
        h = self.model.embed_tokens(input_ids)
        rope_lens = self._dynamic_rope_lens(kv_view) if self.rotary.is_dynamic else None
        cos, sin = self.rotary(positions, rope_lens, h.dtype, kv_view.max_seq_len)
        residual = None
        for layer in self.model.layers:  # at least one: ModelConfig requires a positive count
            h, residual = layer(h, residual, cos, sin, self.backend, kv_view)
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        h, _ = self.model.norm.add_and_norm(h, residual)
        return linear(h, self.lm_head_weight)

    @staticmethod
    def _dynamic_rope_lens(kv_view: KVView) -> torch.Tensor:
        """Per-token length of its request after this step (what dynamic NTK scales by)."""
        if isinstance(kv_view, DecodeKVCache):
            return kv_view.seq_lens
        return torch.repeat_interleave(kv_view.seq_lens, kv_view.extend_lens)

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        """Every Hugging Face tensor name this model expects -> where it is stored."""
        cfg = self.config
        targets: dict[str, WeightTarget] = {}
        params = dict(self.named_parameters())

        def whole(name: str) -> None:
            targets[name] = WeightTarget(name, 0, params[name].shape[0])

        whole("model.embed_tokens.weight")
        whole("model.norm.weight")
        if self.lm_head is not None:
            whole("lm_head.weight")
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for i in range(cfg.num_layers):
            prefix = f"model.layers.{i}"
            attn = f"{prefix}.self_attn"
            suffixes = ["weight"] + (["bias"] if cfg.attention_bias else [])
            for suffix in suffixes:
                fused = f"{attn}.qkv_proj.{suffix}"
                targets[f"{attn}.q_proj.{suffix}"] = WeightTarget(fused, 0, q_rows)
                targets[f"{attn}.k_proj.{suffix}"] = WeightTarget(fused, q_rows, kv_rows)
                targets[f"{attn}.v_proj.{suffix}"] = WeightTarget(fused, q_rows + kv_rows, kv_rows)
            for suffix in ["weight"] + (["bias"] if cfg.mlp_bias else []):
                fused = f"{prefix}.mlp.gate_up_proj.{suffix}"
                targets[f"{prefix}.mlp.gate_proj.{suffix}"] = WeightTarget(fused, 0, cfg.intermediate_size)
                targets[f"{prefix}.mlp.up_proj.{suffix}"] = WeightTarget(
                    fused, cfg.intermediate_size, cfg.intermediate_size
                )
                whole(f"{prefix}.mlp.down_proj.{suffix}")
            for name in (f"{attn}.o_proj.bias", f"{attn}.q_norm.weight", f"{attn}.k_norm.weight"):
                if name in params:
                    whole(name)
            for name in (f"{attn}.o_proj.weight", f"{prefix}.input_layernorm.weight",
                         f"{prefix}.post_attention_layernorm.weight"):
                whole(name)
        return targets
