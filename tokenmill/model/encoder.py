"""EncoderModel: the base of the encoder families (BERT, XLM-RoBERTa), over the same flat ragged
token layout as :class:`~tokenmill.model.causal_lm.CausalLM`.

``forward(input_ids, positions, kv_view, logits_indices, attention_plan, hidden_indices,
token_type_ids)``: every request of the step is a whole input (prefix length 0, the scheduler never
chunks an encoder's request) and attends to all of its own tokens and no other (bidirectional);
keys and values are neither stored nor read, so an encoder's KV cache holds slots for the
scheduler's accounting only (:meth:`EncoderModel.kv_cache_shape`). ``hidden_indices`` rows come back
as the last layer's hidden states (what embeddings pool); ``logits_indices`` rows go through the
family's classification head (:meth:`EncoderModel.classify`; ``[n, num_labels]``, no columns
without a head). Numerics follow transformers' (post-LayerNorm layers, exact or tanh GELU).

A family declares its ``checkpoint_module_names`` (the ``bert.`` / ``roberta.`` prefix of a
classifier's checkpoint), ``position_offset`` (XLM-RoBERTa's positions start after the padding
index) and its head. ``embeddings.position_ids`` (a buffer some checkpoints hold) and, for an
embedder, the pooler a base-model checkpoint carries are skipped.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.cache.views import KVView, PrefillKVCache
from tokenmill.kernels.linear import Linear
from tokenmill.model import parallel
from tokenmill.model.blocks import Embedding, PackedLinear
from tokenmill.model.capabilities import FamilyCapabilities, check_tensor_parallel
from tokenmill.model.config import EncoderConfig, ModelConfig, ModelConfigError

ENCODER_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""config.json's ``hidden_act`` -> the encoder MLP's activation (transformers' ACT2FN)."""


def encoder_config(config: ModelConfig, raw: dict[str, Any], position_offset: int) -> ModelConfig:
    """``config`` with its :class:`EncoderConfig` (``ModelConfig.encoder``); refuses position
    embeddings other than absolute ones and inputs longer than the position table."""
    source = f"config.json of {config.architecture}"
    kind = raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelConfigError(f"{source}: position_embedding_type {kind!r} is not supported (only 'absolute')")
    labels = raw.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) and labels else int(raw.get("num_labels", 1))
    encoder = EncoderConfig(
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        num_labels=num_labels,
        position_offset=position_offset,
    )
    positions = config.max_position_embeddings - position_offset
    if positions < 1:
        raise ModelConfigError(f"{source}: max_position_embeddings leaves no positions after the offset")
    return replace(config, encoder=encoder, max_position_embeddings=positions)


class EncoderEmbeddings(nn.Module):
    """``embeddings.*``: word + absolute position + token type, then LayerNorm."""

    def __init__(self, config: ModelConfig, encoder: EncoderConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = Embedding(config.vocab_size, hidden)
        self.position_embeddings = Embedding(config.max_position_embeddings + encoder.position_offset, hidden)
        self.token_type_embeddings = Embedding(encoder.type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=encoder.layer_norm_eps)
        self.position_offset = encoder.position_offset

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:
            h = h + self.token_type_embeddings.weight[0]
        else:
            h = h + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(h)


class DenseLayerNorm(nn.Module):
    """``dense`` then ``LayerNorm`` over the sum with the residual (BERT's ``*.output`` blocks)."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class SelfAttention(nn.Module):
    """``attention.self`` (q, k, v packed into ``qkv``) and ``attention.output``."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = hidden // config.num_heads
        self.self_attention = nn.Module()
        self.self_attention.qkv = PackedLinear(hidden, (hidden, hidden, hidden), bias=True)
        self.attention_output = DenseLayerNorm(hidden, hidden, eps)

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.self_attention.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = bidirectional_attention(q, k, v, lens, 1.0 / math.sqrt(self.head_dim))
        return self.attention_output(out.reshape(t, -1), x)


class EncoderLayer(nn.Module):
    """``encoder.layer.N``: self-attention, then ``intermediate`` (dense, activation) and ``output``."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.attention = SelfAttention(config, eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.output = DenseLayerNorm(config.intermediate_size, config.hidden_size, eps)
        self.activation = ENCODER_ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        x = self.attention(x, lens)
        return self.output(self.activation(self.intermediate.dense(x)), x)


class EncoderStack(nn.Module):
    """``encoder.*``: the layers."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config, eps) for _ in range(config.num_layers))


def bidirectional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """Softmax attention of each request's rows (consecutive runs of ``lens`` rows of ``q``, ``k``,
    ``v``, each ``[T, heads, head_dim]``) over all of that request's rows; ``[T, heads, head_dim]``.
    One call per request: no padding to compute or copy (faster on CPU than one padded, masked call);
    4-D inputs, which torch's CPU flash kernel takes (3-D ones fall back to the math kernel)."""
    out = torch.empty_like(q)
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        heads_first = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(*heads_first, scale=scale)[0].transpose(0, 1)
        start += n
    return out


class EncoderModel(nn.Module):
    """Embeddings, the encoder layers, and the family's head (none for an embedder)."""

    is_encoder: ClassVar[bool] = True
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
    checkpoint_module_names: ClassVar[dict[str, str]] = {"self_attention": "self", "attention_output": "output"}
    capabilities: ClassVar[FamilyCapabilities] = FamilyCapabilities()
    activations: ClassVar[tuple[str, ...]] = tuple(ENCODER_ACTIVATIONS)
    position_offset: ClassVar[int] = 0
    has_head: ClassVar[bool] = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.encoder is not None, "an encoder's config comes from its family's adjust_config"
        self.config = config
        self.tp = parallel.current()
        check_tensor_parallel(config.architecture, self.capabilities, self.tp.size)
        self.embeddings = EncoderEmbeddings(config, config.encoder)
        self.encoder = EncoderStack(config, config.encoder.layer_norm_eps)
        self.backend: AttentionBackend | None = None  # attention runs in the layers: no backend
        self.quantization = None
        self.checkpoint_quantization = None

    @classmethod
    def adjust_config(cls, config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        offset = cls.position_offset_of(raw)
        return encoder_config(config, raw, offset)

    @classmethod
    def position_offset_of(cls, raw: dict[str, Any]) -> int:
        """Where position 0's embedding is in the table (0; XLM-RoBERTa's: after the padding index)."""
        return cls.position_offset

    def build_rotary(self, device: torch.device | str | None = None) -> None:
        """Nothing to build: encoders' positions are learned embeddings (the loader calls this)."""

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """``(layers, KV heads, head_dim)`` of the KV storage: one one-wide slot per token (an encoder
        keeps no keys or values; the scheduler still counts its tokens in slots)."""
        return 1, 1, 1

    def skips_weight(self, name: str) -> bool:
        """The position-id buffer some checkpoints save; an embedder skips the base model's pooler."""
        return name.endswith("embeddings.position_ids") or (not self.has_head and name.startswith("pooler."))

    def weight_bytes(self) -> int:
        """Bytes of the parameters and buffers."""
        return sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])

    def cpu_decode_weights(self) -> None:
        """Encoders never decode: no C++ decode forward."""
        return None

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """The head's logits ``[n, num_labels]`` of the rows it reads (an embedder: no columns)."""
        return cls_rows.new_zeros((cls_rows.shape[0], 0))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_view: KVView,
        logits_indices: torch.Tensor | None = None,
        attention_plan: object | None = None,
        hidden_indices: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The head's logits of ``logits_indices`` (all rows when None); with ``hidden_indices``:
        ``(logits, hidden)``, ``hidden`` the last layer's states of those rows. ``attention_plan``
        is not used (no backend)."""
        if not isinstance(kv_view, PrefillKVCache) or any(kv_view.prefix_lens_cpu):
            raise ValueError("an encoder runs whole inputs only (prefill steps without a cached prefix)")
        lens = kv_view.extend_lens_cpu
        h = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            h = layer(h, lens)
        logits = self.classify(h if logits_indices is None else h[logits_indices])
        return logits if hidden_indices is None else (logits, h[hidden_indices])
