"""CausalLM: the base of every family, a decoder-only transformer over a flat ragged token layout.

``forward(input_ids, positions, kv_view, logits_indices)``: ``input_ids`` and ``positions`` are
1-D over every token of every request in the step; only the rows in ``logits_indices`` are
projected through the LM head. ``backend`` must be set before the first forward.

A family subclasses :class:`CausalLM` in its own file and declares:

- :meth:`CausalLM.decoder_layer`: its layer, built from ``blocks.py``;
- ``packed_modules``: checkpoint module name -> (packed module, shard) (``weights.py`` derives
  every checkpoint name and the rows it loads into from it and the parameters);
- :meth:`CausalLM.adjust_config`: its config.json quirks, applied to the generic parse;
- ``supports_partial_rotary``: whether its layers follow ``partial_rotary_factor`` < 1 as its
  transformers implementation does (``registry.load_model_config`` refuses it otherwise);
- ``activations``: the MLP activations (``ModelConfig.hidden_act``) its layers implement (the
  registry refuses others); ``norm_class``: its final norm; :meth:`CausalLM.embed`: its embedding;
- ``supports_cpu_decode_forward``: an explicit opt-in, true only when its layer computes exactly
  what ``kernels/cpu/decode_forward.cpp`` computes (see :meth:`CausalLM.cpu_decode_weights`).

Parameter names are Hugging Face's (``model.layers.N.self_attn...``) except for packed projections.

Generic config-driven parts: the attention backend must be built with the config's softmax scale
and attention logit soft-capping (the ``backend`` setter refuses another); final logits are
soft-capped when ``final_logit_softcapping`` is set; sliding-window layers use ``sliding_rope``'s
rotary when the config has one (one cos/sin per rotary and forward).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.factory import make_backend
from tokenmill.cache.views import DecodeKVCache, KVView
from tokenmill.config import EngineConfig
from tokenmill.kernels.linear import Linear, linear
from tokenmill.model import parallel
from tokenmill.model.blocks import RMSNorm, RotaryEmbedding
from tokenmill.model.config import ModelConfig

CPU_DECODE_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)
"""A layer's parameters, in ``decode_forward.cpp``'s order; a layer with any other parameter (a
bias, a q/k norm) is not what the C++ decode forward computes."""


@dataclass(frozen=True)
class CpuDecodeWeights:
    """What the C++ decode forward reads. The Parameter objects themselves are held: weight updates
    copy into them and ``Module.to`` swaps their ``.data``, so they stay current."""

    embed: nn.Parameter
    layers: list[nn.Parameter]  # CPU_DECODE_LAYER_WEIGHTS of each layer, layer after layer
    final_norm: nn.Parameter
    lm_head: nn.Parameter
    projections: list[Linear | None]  # qkv, o, gate_up, down of each layer; the LM head's (None: tied)
    rotary: RotaryEmbedding  # fixed-frequency: its cos/sin table is what the kernel gathers from
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    windows: list[int]  # each layer's sliding window, 0 for global attention


class DecoderStack(nn.Module):
    """``model.*`` in checkpoint names: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        tp = parallel.current()
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = parallel.VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module, ABC):
    """Embeddings, the family's decoder layers, final norm, LM head (tied to the embeddings or not)."""

    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {}
    checkpoint_module_names: ClassVar[dict[str, str]] = {}
    """Module name -> the checkpoint's name for it, where they differ (``weights.py`` applies it)."""
    supports_cpu_decode_forward: ClassVar[bool] = False
    supports_tensor_parallel: ClassVar[bool] = False
    """Whether its layers are built from the tensor-parallel-aware blocks only (``parallel.py``)."""
    supports_partial_rotary: ClassVar[bool] = False
    activations: ClassVar[tuple[str, ...]] = ("silu",)
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = parallel.current()
        if tp.size > 1 and not self.supports_tensor_parallel:
            raise ValueError(f"{config.architecture} does not support tensor_parallel_size > 1")
        layers = [self.decoder_layer(config, i) for i in range(config.num_layers)]
        self.model = DecoderStack(config, layers, self.norm_class)
        self.build_rotary()
        self._sliding_rope_layers = [config.layer_rope(i) is not config.rope for i in range(config.num_layers)]
        if config.tie_word_embeddings:
            self.lm_head = None
        elif tp.size == 1:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.lm_head = parallel.VocabParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.backend = None

    @abstractmethod
    def decoder_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """Layer ``layer_id`` of this family (a :class:`DecoderLayer` or one with its forward signature)."""

    def build_rotary(self, device: torch.device | str | None = None) -> None:
        """(Re)build the rotary embeddings on ``device``: ``rotary`` (``config.rope``) and
        ``sliding_rotary`` (``config.sliding_rope``, None without one). Their buffers are not
        checkpoint weights, so the loader rebuilds them after materializing a meta-initialized model."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope, cfg.max_position_embeddings).to(device)
        self.sliding_rotary = (
            None
            if cfg.sliding_rope is None
            else RotaryEmbedding(cfg.rotary_dim, cfg.sliding_rope, cfg.max_position_embeddings).to(device)
        )

    @property
    def attention_scale(self) -> float:
        """The softmax scale of this model's attention (``config.attention_scale``, default ``head_dim ** -0.5``)."""
        scale = self.config.attention_scale
        return self.config.head_dim**-0.5 if scale is None else scale

    @property
    def backend(self) -> AttentionBackend | None:
        """The attention backend every layer calls; set before the first forward."""
        return self._backend

    @backend.setter
    def backend(self, backend: AttentionBackend | None) -> None:
        """Refuses (ValueError) a backend built for another softmax scale or soft-capping than the config's."""
        if backend is not None:
            softcap = self.config.attn_logit_softcapping
            if not math.isclose(backend.scale, self.attention_scale, rel_tol=1e-9) or backend.softcap != softcap:
                raise ValueError(
                    f"{type(self).__name__} needs an attention backend with scale {self.attention_scale} and "
                    f"softcap {softcap}; got scale {backend.scale} and softcap {backend.softcap}"
                )
        self._backend = backend

    def make_backend(self, engine_config: EngineConfig, dtype: torch.dtype) -> AttentionBackend:
        """The attention backend ``engine_config.attention_backend`` names for this model: its head
        shape, softmax scale and soft-cap, and whether any layer slides (a backend that cannot
        apply windows is then refused, or skipped by "auto")."""
        cfg = self.config
        return make_backend(
            engine_config,
            *self.local_heads(),
            cfg.head_dim,
            dtype,
            any(cfg.layer_sliding_window(i) is not None for i in range(cfg.num_layers)),
            scale=cfg.attention_scale,
            softcap=cfg.attn_logit_softcapping,
        )

    def local_heads(self) -> tuple[int, int]:
        """``(query heads, KV heads)`` this rank computes and caches (all of them at tp=1)."""
        cfg, size = self.config, self.tp.size
        return cfg.num_heads // size, max(cfg.num_kv_heads // size, 1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (a family may scale them)."""
        return self.model.embed_tokens(input_ids)

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        """The generic parse of ``raw`` corrected for this family's conventions (none by default)."""
        return config

    def skips_weight(self, name: str) -> bool:
        """Checkpoint tensors that are not weights of this model: RoPE caches, a tied LM head."""
        return name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")

    @property
    def lm_head_weight(self) -> nn.Parameter:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def cpu_decode_weights(self) -> CpuDecodeWeights | None:
        """The weights of the C++ decode forward, or None when it would not compute this model.

        Allow-list: the family opted in (``supports_cpu_decode_forward``), RoPE has fixed
        frequencies and rotates whole heads, and every layer has exactly :data:`CPU_DECODE_LAYER_WEIGHTS`.
        """
        if (
            not self.supports_cpu_decode_forward
            or self.tp.size > 1
            or self.rotary.is_dynamic
            or self.rotary.dim != self.config.head_dim
            or self.sliding_rotary is not None
            or self.config.hidden_act != "silu"
        ):
            return None
        weights: list[nn.Parameter] = []
        projections: list[Linear | None] = []
        for layer in self.model.layers:
            params = dict(layer.named_parameters())
            if params.keys() != set(CPU_DECODE_LAYER_WEIGHTS):
                return None
            weights.extend(params[name] for name in CPU_DECODE_LAYER_WEIGHTS)
            attn, mlp = layer.self_attn, layer.mlp
            projections.extend((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
        projections.append(self.lm_head)
        cfg = self.config
        return CpuDecodeWeights(
            embed=self.model.embed_tokens.weight,
            layers=weights,
            final_norm=self.model.norm.weight,
            lm_head=self.lm_head_weight,
            projections=projections,
            rotary=self.rotary,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            windows=[layer.self_attn.sliding_window or 0 for layer in self.model.layers],
        )

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
            raise RuntimeError(f"{type(self).__name__}.backend must be set before forward")
        h = self.embed(input_ids)
        sliding = self.sliding_rotary
        dynamic = self.rotary.is_dynamic or (sliding is not None and sliding.is_dynamic)
        rope_lens = self._dynamic_rope_lens(kv_view) if dynamic else None
        cos_sin = self.rotary(positions, rope_lens, h.dtype, kv_view.max_seq_len)
        sliding_cos_sin = cos_sin if sliding is None else sliding(positions, rope_lens, h.dtype, kv_view.max_seq_len)
        residual = None
        for layer, slides in zip(self.model.layers, self._sliding_rope_layers):  # at least one layer
            cos, sin = sliding_cos_sin if slides else cos_sin
            h, residual = layer(h, residual, cos, sin, self.backend, kv_view)
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        h, _ = self.model.norm.add_and_norm(h, residual)
        logits = linear(h, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)
        if self.tp.size > 1:
            logits = parallel.gather_logits(self.tp, logits, self.config.vocab_size)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @staticmethod
    def _dynamic_rope_lens(kv_view: KVView) -> torch.Tensor:
        """Per-token length of its request after this step (what dynamic NTK scales by and longrope
        picks its factors by)."""
        if isinstance(kv_view, DecodeKVCache):
            return kv_view.seq_lens
        return torch.repeat_interleave(kv_view.seq_lens, kv_view.extend_lens)
