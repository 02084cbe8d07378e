"""Shared building blocks of decoder-only families: norms, rotary embedding, packed linears,
gated MLP, attention block, decoder layer.

Numerics follow the Hugging Face implementations exactly (normalization in fp32, RoPE in the
"rotate_half" layout with fp32 frequencies). Projections that a checkpoint stores separately are
packed into one :class:`PackedLinear` (``qkv_proj``: q, k, v stacked on the output dimension;
``gate_up_proj``: gate, up), and a family's ``packed_modules`` maps the checkpoint's names onto
the packed shards (:data:`SPLIT_PROJECTIONS` for the usual ``q_proj`` ... ``up_proj``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.kernels.fused import GATED_ACTIVATIONS, add_rms_norm, apply_rotary, rms_norm, rotary_split_qkv
from tokenmill.kernels.linear import Linear
from tokenmill.model import parallel
from tokenmill.model.config import ModelConfig, RopeConfig

SPLIT_PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""Checkpoint module name -> (packed module name, shard) for checkpoints that store q, k, v and
gate, up as separate projections."""


class Embedding(nn.Embedding):
    """``nn.Embedding`` that leaves a table on the meta device uninitialized (models are built there
    and then loaded): torch's ``normal_`` on a meta tensor imports ``torch._dynamo``, a second of
    every start."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; may update ``residual`` in place (see ``add_rms_norm``)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin for the given positions, for every supported ``rope_type``, over the ``dim`` rotated
    dims of a head (``ModelConfig.rotary_dim``: all of it unless ``partial_rotary_factor`` < 1).

    Length-dependent types (:attr:`is_dynamic`) take the per-token length of its request after the
    current forward (``seq_lens``), which is what transformers sees per forward call of one request
    (``max(position_ids) + 1``): "dynamic" (NTK) recomputes the base from it; "longrope" uses the
    short factors for a request of at most ``original_max_position_embeddings`` tokens, the long
    ones beyond. So a request matches transformers' ``generate`` when each of its forwards computes
    what transformers' does; not when tokenmill splits or merges them differently: a prefill chunked
    (or recomputed after preemption, or partly reused from the prefix cache) across the threshold
    rotates its earlier chunks with the factors of a shorter length than transformers' one-shot
    prefill of the whole prompt does.

    The other types use a fixed ``inv_freq``, so their cos/sin rows are computed once into a table
    (grown to the next power of two when a forward needs more positions) and gathered per forward:
    one index per tensor instead of ~10 small ops, which matter in a CPU decode step. A CUDA-graph
    capture's warm-up forward sizes the table for the captured upper bound first, so a capture never
    grows (reallocates) it.
    """

    def __init__(self, dim: int, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        self.dim = dim
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_factor = _inv_freq(dim, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("exponents", exponents, persistent=False)
        if rope.rope_type == "longrope":
            assert rope.long_factor is not None
            self.register_buffer("long_inv_freq", _longrope_inv_freq(dim, rope, rope.long_factor), persistent=False)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [n, dim]

    @property
    def is_dynamic(self) -> bool:
        """Whether cos/sin depend on the request's length, not only on the position (no table)."""
        return self.rope.rope_type in ("dynamic", "longrope")

    def forward(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None, dtype: torch.dtype, n_positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[T, dim]`` for ``positions`` (all ``< n_positions``); ``seq_lens``
        (per token: its request's length after this forward) only for :attr:`is_dynamic` types."""
        if self.is_dynamic:
            assert seq_lens is not None, f"{self.rope.rope_type} RoPE needs the per-token request length"
            if self.rope.rope_type == "longrope":
                is_long = (seq_lens > self.rope.original_max_position_embeddings)[:, None]
                inv_freq = torch.where(is_long, self.long_inv_freq[None, :], self.inv_freq[None, :])
                return self._cos_sin(positions.float()[:, None] * inv_freq, dtype)
            mpe = self.max_position_embeddings
            length = torch.clamp(seq_lens.float(), min=mpe)
            factor = self.rope.factor
            exponent = self.dim / (self.dim - 2)
            base = self.rope.theta * ((factor * length / mpe) - (factor - 1)) ** exponent
            inv_freq = 1.0 / (base[:, None] ** self.exponents[None, :])
            return self._cos_sin(positions.float()[:, None] * inv_freq, dtype)
        cos_table, sin_table = self.table(n_positions, dtype, positions.device)
        return cos_table[positions], sin_table[positions]

    def table(self, n_positions: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, dim]`` (``n >= n_positions``) of positions ``0 .. n-1``; fixed-frequency
        rope types only."""
        assert not self.is_dynamic, f"{self.rope.rope_type} RoPE has no position table"
        table = self._table
        if table is None or (table[0].dtype, table[0].device) != (dtype, device) or table[0].shape[0] < n_positions:
            size = 1 << max(n_positions - 1, 1).bit_length()
            freqs = torch.arange(size, device=device).float()[:, None] * self.inv_freq[None, :]
            table = self._table = self._cos_sin(freqs, dtype)
        return table

    def _cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (times the attention factor) of ``freqs`` ``[T, dim / 2]``, in the
        rotate_half layout ``[T, dim]``."""
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def _inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor: the type's, divided by ``rope.freq_factors`` if set."""
    inv_freq, attention_factor = _type_inv_freq(dim, rope)
    if rope.freq_factors is None:
        return inv_freq, attention_factor
    return inv_freq / torch.tensor(rope.freq_factors, dtype=inv_freq.dtype), attention_factor


def _type_inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor (the transformers formulas for each type)."""
    base_inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.rope_type
    if kind in ("default", "dynamic"):
        return base_inv, 1.0
    if kind == "linear":
        return base_inv / rope.factor, 1.0
    if kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / base_inv
        scaled = torch.where(wavelen > low_wavelen, base_inv / rope.factor, base_inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, rope)
    if kind == "longrope":  # the short factors; RotaryEmbedding also holds the long ones
        assert rope.short_factor is not None and rope.original_max_position_embeddings is not None
        attention_factor = rope.attention_factor
        if attention_factor is None:
            original = rope.original_max_position_embeddings
            attention_factor = 1.0 if rope.factor <= 1 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
        return _longrope_inv_freq(dim, rope, rope.short_factor), float(attention_factor)
    raise ValueError(f"unsupported rope type {kind!r}")


def _longrope_inv_freq(dim: int, rope: RopeConfig, ext_factors: Sequence[float]) -> torch.Tensor:
    """LongRoPE's inverse frequencies: the default ones, each divided by its factor."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * rope.theta**exponents)


def _yarn_inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    factor = rope.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class PackedLinear(Linear):
    """A Linear whose output rows stack several checkpoint projections, computed in one matmul.

    Shard ``i`` (``shard_sizes[i]`` rows) is rows :meth:`shard_rows` ``(i)`` of the weight and bias, and
    holds rows ``source_rows[i]`` of its checkpoint projection of ``source_sizes[i]`` rows (all of them
    when ``source_rows`` is None; a block of them in a column-parallel layer, see ``parallel.py``).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: Sequence[int],
        bias: bool,
        source_rows: Sequence[slice] | None = None,
        source_sizes: Sequence[int] = (),
    ) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = tuple(shard_sizes)
        self.source_rows = None if source_rows is None else tuple(source_rows)
        self.source_sizes = source_sizes

    def shard_part(self, shard: int, leaf: str) -> parallel.CheckpointPart | None:
        """The part of shard ``shard``'s checkpoint tensor (``leaf``: weight or bias) it holds (None: all)."""
        if self.source_rows is None:
            return None
        rows = self.source_sizes[shard]
        return parallel.CheckpointPart(
            (rows, self.in_features) if leaf == "weight" else (rows,), (self.source_rows[shard],)
        )

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up packed into one matmul; ``act`` is SiLU
    (SwiGLU) unless ``activation`` names another of ``fused.GATED_ACTIVATIONS`` (GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, activation: str = "silu") -> None:
        super().__init__()
        tp = parallel.current()
        if tp.size == 1:
            self.gate_up_proj = PackedLinear(hidden, (intermediate, intermediate), bias=bias)
            self.down_proj = Linear(intermediate, hidden, bias=bias)
        else:  # column-parallel gate/up, row-parallel down: this rank's block of the intermediate width
            block = tp.block(intermediate, "intermediate_size")
            width = block.stop - block.start
            self.gate_up_proj = PackedLinear(hidden, (width, width), bias, (block, block), (intermediate, intermediate))
            self.down_proj = parallel.RowParallelLinear(intermediate, hidden, bias, tp, block)
        self.act_and_mul = GATED_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Self-attention: packed q/k/v, optional per-head q/k RMSNorm (of class ``norm``) before RoPE, a
    pluggable backend; within the layer's sliding window when its config gives it one
    (``ModelConfig.layer_sliding_window``)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.sliding_window = config.layer_sliding_window(layer_id)
        self.head_dim = dim = config.head_dim
        tp = parallel.current()
        if tp.size == 1:
            self.n_heads = config.num_heads
            self.n_kv_heads = config.num_kv_heads
            q_size = self.n_heads * dim
            kv_size = self.n_kv_heads * dim
            self.qkv_proj = PackedLinear(config.hidden_size, (q_size, kv_size, kv_size), bias=qkv_bias)
            self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        else:  # this rank's block of query heads and the KV heads they read; row-parallel o_proj
            heads = tp.block(config.num_heads, "num_attention_heads")
            kv_heads = parallel.kv_head_block(tp, config.num_heads, config.num_kv_heads)
            self.n_heads = heads.stop - heads.start
            self.n_kv_heads = kv_heads.stop - kv_heads.start
            q_rows, kv_rows = parallel.scaled(heads, dim), parallel.scaled(kv_heads, dim)
            sizes = (self.n_heads * dim, self.n_kv_heads * dim, self.n_kv_heads * dim)
            full = (config.num_heads * dim, config.num_kv_heads * dim, config.num_kv_heads * dim)
            self.qkv_proj = PackedLinear(config.hidden_size, sizes, qkv_bias, (q_rows, kv_rows, kv_rows), full)
            self.o_proj = parallel.RowParallelLinear(config.num_heads * dim, config.hidden_size, o_bias, tp, q_rows)
        if qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        plan: object,
    ) -> torch.Tensor:
        n_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is None:
            q, k, v = rotary_split_qkv(qkv, cos, sin, self.n_heads, self.n_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
            q = apply_rotary(self.q_norm(q.reshape(n_tokens, self.n_heads, self.head_dim)), cos, sin)
            k = apply_rotary(self.k_norm(k.reshape(n_tokens, self.n_kv_heads, self.head_dim)), cos, sin)
            v = v.reshape(n_tokens, self.n_kv_heads, self.head_dim)
        out = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), self.layer_id, plan, self.sliding_window)
        return self.o_proj(out.reshape(n_tokens, self.n_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: RMSNorm, attention, RMSNorm, MLP, each with a residual sum."""

    def __init__(self, config: ModelConfig, self_attn: Attention, mlp: GatedMLP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        plan: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried unsummed: the layer's input is ``h + residual`` (``h`` alone
        for the first layer), its output ``(mlp_out, residual)``; each sum is fused into the next norm."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(x, cos, sin, backend, plan), residual)
        return self.mlp(x), residual
