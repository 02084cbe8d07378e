"""The supported architectures: config.json's ``architectures`` name -> model class.

A new family is its file plus one line in :data:`MODELS`. :func:`load_model_config` is the one way
to read a checkpoint's :class:`ModelConfig`: the generic parse, corrected by the family's
``adjust_config`` and checked against what the family supports (``capabilities.partial_rotary``,
``activations``).
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import EngineConfig, Resolved
from tokenmill.model.bert import BertForSequenceClassification, BertModel
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig, ModelConfigError, architecture, read_config_json
from tokenmill.model.encoder import EncoderModel
from tokenmill.model.gemma2 import Gemma2ForCausalLM
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.qwen2 import Qwen2ForCausalLM
from tokenmill.model.qwen3 import Qwen3ForCausalLM
from tokenmill.model.qwen3_moe import Qwen3MoeForCausalLM
from tokenmill.model.xlm_roberta import XLMRobertaForSequenceClassification, XLMRobertaModel

Model = CausalLM | EncoderModel
"""A loaded model: a decoder (generates, embeds, scores from its logits) or an encoder (embeds, scores)."""

MODELS: dict[str, type[CausalLM] | type[EncoderModel]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


def model_class(arch: object, source: str = "config.json") -> type[CausalLM] | type[EncoderModel]:
    """The class of architecture ``arch``; :class:`ModelConfigError` naming the supported ones."""
    cls = MODELS.get(arch) if isinstance(arch, str) else None
    if cls is None:
        raise ModelConfigError(f"{source}: unsupported architecture {arch!r}; supported: {', '.join(MODELS)}")
    return cls


def load_model_config(path: str | Path) -> ModelConfig:
    """The family-adjusted config of the checkpoint folder ``path``."""
    raw, source = read_config_json(path)
    cls = model_class(architecture(raw), source)
    config = cls.adjust_config(ModelConfig.from_dict(raw, source), raw)
    if config.rotary_dim != config.head_dim and not cls.capabilities.partial_rotary:
        raise ModelConfigError(f"{source}: partial_rotary_factor != 1 is not supported for {config.architecture}")
    if config.hidden_act not in cls.activations:
        raise ModelConfigError(
            f"{source}: activation {config.hidden_act!r} is not supported for {config.architecture} "
            f"(supported: {', '.join(cls.activations)})"
        )
    return config


def resolve_config(config: EngineConfig) -> tuple[Resolved, ModelConfig]:
    """``config``'s derived values for its checkpoint (converted or fetched on first use), and the
    checkpoint's family-adjusted config: read once per engine (and once per tensor-parallel worker)."""
    path = config.model_path()
    model_config = load_model_config(path)
    return config.resolve(path, model_config.checkpoint_dtype, model_config.max_context_len), model_config
