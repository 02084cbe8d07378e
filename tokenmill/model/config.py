"""ModelConfig: the parts of a Hugging Face ``config.json`` that the model code needs.

Parsing here is generic: it knows the field names shared by decoder-only checkpoints, in both the
transformers-4 layout (``rope_theta`` + ``rope_scaling``) and the transformers-5 layout
(``rope_parameters``), and no architecture names. Which architectures run, and each family's
quirks, belong to the family files; ``registry.load_model_config`` is the entry point that applies
them. Every rejection is a :class:`ModelConfigError` naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import DTYPES

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class ModelConfigError(ValueError):
    """A config.json that tokenmill cannot run; the message names the file and the field."""


@dataclass
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` one of :data:`ROPE_TYPES`).

    ``partial_rotary_factor``: the fraction of each head's dims that RoPE rotates (the first
    ``int(head_dim * partial_rotary_factor)``, see ``ModelConfig.rotary_dim``); only families with
    ``capabilities.partial_rotary`` accept a value other than 1. "longrope": ``short_factor`` and
    ``long_factor`` (one per rotated frequency) divide the frequencies of a request no longer /
    longer than ``original_max_position_embeddings``. ``freq_factors`` (one per rotated frequency;
    a GGUF file's ``rope_freqs`` tensor, as llama.cpp stores Llama 3.1's scaling) divide the
    frequencies of a fixed-frequency type.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    freq_factors: list[float] | None = None


@dataclass
class MoEConfig:
    """A mixture-of-experts MLP: ``num_experts`` SwiGLU experts of ``intermediate_size``, each token
    routed to ``top_k`` of them by a softmax router (top-k weights renormalized to sum 1 when
    ``renormalize``), in the layers ``sparse_layers`` (the others keep the dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class EncoderConfig:
    """What an encoder reads of config.json beyond :class:`ModelConfig`."""

    layer_norm_eps: float
    type_vocab_size: int
    num_labels: int  # rows of a classification head (``id2label``'s size)
    position_offset: int  # position ``p`` of an input reads position embedding ``p + position_offset``


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a transformer (a decoder; an encoder's extras in ``encoder``).

    ``attention_bias``, ``mlp_bias`` are config.json's flags; a family may build its layers
    differently (its file says how).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    sliding_window_layers: frozenset[int] | None = None  # the layers that slide; None: all (see layer_sliding_window)
    checkpoint_dtype: torch.dtype | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoEConfig | None = None  # set by mixture-of-experts families (their adjust_config)
    encoder: EncoderConfig | None = None  # set by encoder families (their adjust_config)
    hidden_act: str = "silu"  # the MLP's gate activation; the family's ``activations`` must list it
    attention_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_rope: RopeConfig | None = None  # RoPE of the sliding-window layers where not ``rope``

    @property
    def max_context_len(self) -> int:
        """Longest sequence this model runs: ``max_position_embeddings`` (sliding-window layers attend
        to their window of it, see :meth:`layer_sliding_window`); with "dynamic" (NTK) RoPE, which
        rescales its base for sequences past ``max_position_embeddings``, ``factor`` times that
        (transformers sets no bound; the factor is the extension the checkpoint declares)."""
        if self.rope.rope_type == "dynamic":
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_id: int) -> int | None:
        """The attention window of layer ``layer_id``: its query at position ``p`` attends to keys at
        positions ``p - W < k <= p`` (transformers' ``sliding_window_overlay``); None: every earlier key.
        Every layer slides when ``sliding_window`` is set, unless a family lists ``sliding_window_layers``."""
        if self.sliding_window is None or (
            self.sliding_window_layers is not None and layer_id not in self.sliding_window_layers
        ):
            return None
        return self.sliding_window

    def layer_rope(self, layer_id: int) -> RopeConfig:
        """The RoPE of layer ``layer_id``: ``sliding_rope`` for a sliding-window layer when set, else ``rope``."""
        if self.sliding_rope is not None and self.layer_sliding_window(layer_id) is not None:
            return self.sliding_rope
        return self.rope

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (``head_dim`` unless partial)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse the generic fields of ``raw`` (``source`` names it in errors)."""
        arch = architecture(raw)
        if arch is None:
            raise ModelConfigError(f"{source}: missing required field 'architectures'")

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(f"{source}: missing required field {key!r}")
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{source}: {key!r} must be a positive integer, got {value!r}")
            return value

        hidden = need("hidden_size")
        num_heads = need("num_attention_heads")
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        hidden_act = raw.get("hidden_act") or "silu"  # which ones run: the family's ``activations``
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope = parse_rope(raw, source)
        _check_rotary(rope, head_dim, source)
        dtype_name = raw.get("torch_dtype") or raw.get("dtype")
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings") or 2048,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw, source),
            checkpoint_dtype=DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            hidden_act=str(hidden_act),
        )


def _sliding_window(raw: dict[str, Any], source: str) -> int | None:
    """config.json's ``sliding_window``: a positive integer or absent/null."""
    window = raw.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ModelConfigError(f"{source}: 'sliding_window' must be a positive integer or null, got {window!r}")
    return window


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """The JSON object in ``path/config.json`` and that file's name (for error messages)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {Path(path)}: not a Hugging Face checkpoint folder")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
    return raw, str(config_path)


def architecture(raw: dict[str, Any]) -> Any:
    """The first entry of ``architectures`` (what selects the model class), None when absent."""
    archs = raw.get("architectures") or []
    return archs[0] if archs else None


def parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    """Read RoPE settings from either ``rope_parameters`` (v5) or ``rope_theta``/``rope_scaling`` (v4)."""
    params: dict[str, Any] = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor")
    if partial is None:
        partial = raw.get("partial_rotary_factor")
    partial = 1.0 if partial is None else partial
    rope = RopeConfig(rope_type=rope_type, theta=float(theta), partial_rotary_factor=float(partial))
    freq_factors = params.get("freq_factors")
    if freq_factors is not None:
        if not isinstance(freq_factors, list) or not all(isinstance(x, (int, float)) and x > 0 for x in freq_factors):
            raise ModelConfigError(f"{source}: 'freq_factors' must be a list of positive numbers")
        if rope_type in ("dynamic", "longrope"):
            raise ModelConfigError(f"{source}: 'freq_factors' with rope type {rope_type!r} is not supported")
        rope.freq_factors = [float(x) for x in freq_factors]
    if rope_type == "default":
        return rope
    factor = params.get("factor")
    if factor is None and rope_type not in ("yarn", "longrope"):
        raise ModelConfigError(f"{source}: rope type {rope_type!r} needs a 'factor'")
    # transformers gives a top-level original_max_position_embeddings precedence over rope_parameters'
    original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if original is None and rope_type in ("llama3", "yarn", "longrope"):
        original = raw.get("max_position_embeddings") or 2048
    if factor is None:  # yarn, longrope without factor: derived from the context extension
        factor = (raw.get("max_position_embeddings") or 2048) / original
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            value = params.get(name)
            if not isinstance(value, list) or not all(isinstance(x, (int, float)) for x in value):
                raise ModelConfigError(f"{source}: rope type 'longrope' needs {name!r}, a list of numbers")
            setattr(rope, name, [float(x) for x in value])
    rope.factor = float(factor)
    rope.original_max_position_embeddings = original
    for name in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim", "truncate"):
        if params.get(name) is not None:
            setattr(rope, name, params[name])
    for name in ("beta_fast", "beta_slow"):
        if params.get(name):
            setattr(rope, name, float(params[name]))
    return rope


def _check_rotary(rope: RopeConfig, head_dim: int, source: str) -> None:
    """The rotated dims are an even count within the head; longrope and ``freq_factors`` a factor per frequency."""
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ModelConfigError(
            f"{source}: partial_rotary_factor {rope.partial_rotary_factor} gives {rotary_dim} rotary dims of "
            f"head_dim {head_dim}; needs an even count in (0, head_dim]"
        )
    for name in ("short_factor", "long_factor", "freq_factors"):
        factors = getattr(rope, name)
        if factors is not None and len(factors) != rotary_dim // 2:
            raise ModelConfigError(
                f"{source}: rope {name!r} has {len(factors)} entries, expected {rotary_dim // 2} (rotary dims / 2)"
            )
