"""CausalLM: the base of every family, a decoder-only transformer over a flat ragged token layout.

``forward(input_ids, positions, kv_view, logits_indices, attention_plan, hidden_indices)``:
``input_ids`` and ``positions`` are 1-D over every token of every request in the step; only the
rows in ``logits_indices`` are projected through the LM head; with ``hidden_indices`` the forward
also returns those rows' hidden states after the final norm (what pooling requests embed).
``backend`` must be set before the first forward; the forward plans the backend's metadata from
``kv_view`` once (unless given the plan, as the CUDA-graph runner does) and hands that plan to
every layer.

A family subclasses :class:`CausalLM` in its own file and declares:

- :meth:`CausalLM.decoder_layer`: its layer, built from ``blocks.py``;
- ``packed_modules``: checkpoint module name -> (packed module, shard) (``weights.py`` derives
  every checkpoint name and the rows it loads into from it and the parameters);
- :meth:`CausalLM.adjust_config`: its config.json quirks, applied to the generic parse;
- ``capabilities``: its row of the capability table (:class:`FamilyCapabilities`: tensor
  parallelism, the C++ decode forward, partial rotary), checked in ``model/capabilities.py``;
- ``activations``: the MLP activations (``ModelConfig.hidden_act``) its layers implement (the
  registry refuses others); ``norm_class``: its final norm; :meth:`CausalLM.embed`: its embedding.

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
from tokenmill.attention.factory import BackendShape, build_backend
from tokenmill.cache.views import DecodeKVCache, KVView
from tokenmill.config import EngineConfig
from tokenmill.kernels.linear import Linear, linear
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.model import parallel
from tokenmill.model.blocks import Embedding, RMSNorm, RotaryEmbedding
from tokenmill.model.capabilities import Combination, FamilyCapabilities, check_tensor_parallel, choose_backend
from tokenmill.model.config import ModelConfig
from tokenmill.model.moe import Experts

CPU_DECODE_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)
"""A layer's weights, in ``decode_forward.cpp``'s order (a quantized projection's ``weight`` is its
packed ``qweight``); a layer with any other parameter (a bias, a q/k norm) is not what the C++
decode forward computes."""


@dataclass(frozen=True)
class CpuDecodeWeights:
    """What the C++ decode forward reads. The tensor objects themselves are held: weight updates
    copy into them and ``Module.to`` swaps their ``.data``, so they stay current."""

    embed: nn.Parameter
    layers: list[torch.Tensor]  # CPU_DECODE_LAYER_WEIGHTS of each layer, layer after layer
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
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = parallel.VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module, ABC):
    """Embeddings, the family's decoder layers, final norm, LM head (tied to the embeddings or not)."""

    is_encoder: ClassVar[bool] = False
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {}
    checkpoint_module_names: ClassVar[dict[str, str]] = {}
    """Module name -> the checkpoint's name for it, where they differ (``weights.py`` applies it)."""
    capabilities: ClassVar[FamilyCapabilities] = FamilyCapabilities()
    activations: ClassVar[tuple[str, ...]] = ("silu",)
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = parallel.current()
        check_tensor_parallel(config.architecture, self.capabilities, tp.size)
        layers = [self.decoder_layer(config, i) for i in range(config.num_layers)]
        self.model = DecoderStack(config, layers, self.norm_class)
        # a model built on the meta device gets its tables on the CPU (torch's meta versions of their
        # ops import torch._dynamo, a second of every start); the loader rebuilds them on the weights' device
        self.build_rotary("cpu" if torch.get_default_device().type == "meta" else None)
        self._sliding_rope_layers = [config.layer_rope(i) is not config.rope for i in range(config.num_layers)]
        if config.tie_word_embeddings:
            self.lm_head = None
        elif tp.size == 1:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.lm_head = parallel.VocabParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.backend = None
        self.quantization: QuantScheme | None = None  # set by model/quantization.py or model/prequantized.py
        self.checkpoint_quantization: str | None = None  # a pre-quantized checkpoint's quant_method (prequantized.py)

    @abstractmethod
    def decoder_layer(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """Layer ``layer_id`` of this family (a :class:`DecoderLayer` or one with its forward signature)."""

    def build_rotary(self, device: torch.device | str | None = None) -> None:
        """(Re)build the rotary embeddings on ``device``: ``rotary`` (``config.rope``) and
        ``sliding_rotary`` (``config.sliding_rope``, None without one). Their buffers are not
        checkpoint weights, so the loader rebuilds them after materializing a meta-initialized model."""
        cfg = self.config
        with torch.device(device if device is not None else torch.get_default_device()):
            self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope, cfg.max_position_embeddings)
            self.sliding_rotary = (
                None
                if cfg.sliding_rope is None
                else RotaryEmbedding(cfg.rotary_dim, cfg.sliding_rope, cfg.max_position_embeddings)
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
        """The attention backend ``engine_config.attention_backend`` names ("auto": chosen) for this
        model in ``dtype``, after checking the whole combination against the capability table
        (ValueError naming what is unsupported); built for its heads, softmax scale and soft-cap."""
        cfg = self.config
        combo = Combination(
            architecture=cfg.architecture,
            family=self.capabilities,
            device=engine_config.resolved_device(),
            dtype=dtype,
            kv_dtype=engine_config.resolved_kv_dtype(dtype),
            tensor_parallel_size=self.tp.size,
            sliding_window=any(cfg.layer_sliding_window(i) is not None for i in range(cfg.num_layers)),
            softcap=cfg.attn_logit_softcapping is not None,
        )
        name = choose_backend(engine_config.attention_backend, combo)
        shape = BackendShape(*self.local_heads(), cfg.head_dim, cfg.attention_scale, cfg.attn_logit_softcapping)
        return build_backend(name, shape, engine_config)

    def local_heads(self) -> tuple[int, int]:
        """``(query heads, KV heads)`` this rank computes and caches (all of them at tp=1)."""
        cfg, size = self.config, self.tp.size
        return cfg.num_heads // size, max(cfg.num_kv_heads // size, 1)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """``(layers, KV heads, head_dim)`` of this rank's KV storage."""
        return self.config.num_layers, self.local_heads()[1], self.config.head_dim

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

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters and buffers (quantized weights at their packed size)."""
        return sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding table (tied), the head's, or its packed quantized one."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.qweight if self.lm_head.quantization is not None else self.lm_head.weight

    def make_blocked_copies(self) -> None:
        """Make every blocked weight copy the products will use (``kernels/linear.py``) now, at
        start-up, so that the first requests are as fast as the later ones."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.make_blocked_copy()
            elif isinstance(module, Experts):
                module.make_blocked_copies()

    def cpu_decode_weights(self) -> CpuDecodeWeights | None:
        """The weights of the C++ decode forward, or None when it would not compute this instance
        (whether the family and backend allow it at all is ``capabilities.cpu_decode_forward_applies``).

        Allow-list: RoPE has fixed frequencies and rotates whole heads, and every layer has exactly
        :data:`CPU_DECODE_LAYER_WEIGHTS`.
        """
        if (
            self.rotary.is_dynamic
            or self.rotary.dim != self.config.head_dim
            or self.sliding_rotary is not None
            or self.config.hidden_act != "silu"
        ):
            return None
        weights: list[torch.Tensor] = []
        projections: list[Linear | None] = []
        for layer in self.model.layers:
            params: dict[str, torch.Tensor] = dict(layer.named_parameters())
            params.update(
                (f"{name}.weight", module.qweight)
                for name, module in layer.named_modules()
                if isinstance(module, Linear) and module.quantization is not None
            )
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
        attention_plan: object | None = None,
        hidden_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[len(logits_indices), vocab]`` (all rows when ``logits_indices`` is None).
        ``attention_plan``: the backend's plan of ``kv_view`` when the caller made it (None: planned here).
        With ``hidden_indices``: ``(logits, hidden)``, ``hidden`` the final-normed hidden states of
        those rows (``[len(hidden_indices), hidden_size]``, the model's dtype)."""
        if self.backend is None:
            raise RuntimeError(f"{type(self).__name__}.backend must be set before forward")
        plan = self.backend.plan(kv_view) if attention_plan is None else attention_plan
        h = self.embed(input_ids)
        sliding = self.sliding_rotary
        dynamic = self.rotary.is_dynamic or (sliding is not None and sliding.is_dynamic)
        rope_lens = self._dynamic_rope_lens(kv_view) if dynamic else None
        cos_sin = self.rotary(positions, rope_lens, h.dtype, kv_view.max_seq_len)
        sliding_cos_sin = cos_sin if sliding is None else sliding(positions, rope_lens, h.dtype, kv_view.max_seq_len)
        residual = None
        for layer, slides in zip(self.model.layers, self._sliding_rope_layers):  # at least one layer
            cos, sin = sliding_cos_sin if slides else cos_sin
            h, residual = layer(h, residual, cos, sin, self.backend, plan)
        hidden = None
        if hidden_indices is not None:  # indexing copies: the norm below cannot touch these rows
            hidden, _ = self.model.norm.add_and_norm(h[hidden_indices], residual[hidden_indices])
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        h, _ = self.model.norm.add_and_norm(h, residual)
        logits = linear(h, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)
        if self.tp.size > 1:
            logits = parallel.gather_logits(self.tp, logits, self.config.vocab_size)
        cap = self.config.final_logit_softcapping
        logits = logits if cap is None else torch.tanh(logits / cap) * cap
        return logits if hidden is None else (logits, hidden)

    @staticmethod
    def _dynamic_rope_lens(kv_view: KVView) -> torch.Tensor:
        """Per-token length of its request after this step (what dynamic NTK scales by and longrope
        picks its factors by)."""
        if isinstance(kv_view, DecodeKVCache):
            return kv_view.seq_lens
        return torch.repeat_interleave(kv_view.seq_lens, kv_view.extend_lens)
