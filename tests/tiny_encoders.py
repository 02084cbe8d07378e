"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa; embedders and one-label cross-encoders)
with a word-level tokenizer of each one's pair template, and optionally sentence-transformers'
module files, saved as a folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, processors

from tests.tiny_tokenizer import WORDS

ENCODER_BASE: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.08,
)

KINDS = {
    "bert": (transformers.BertConfig, transformers.BertModel),
    "bert-cross": (transformers.BertConfig, transformers.BertForSequenceClassification),
    "xlmr": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
    "xlmr-cross": (transformers.XLMRobertaConfig, transformers.XLMRobertaForSequenceClassification),
}
"""Kind -> (config class, model class); "-cross" kinds are one-label cross-encoders."""

SPECIALS = {"bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "xlmr": ["<s>", "<pad>", "</s>", "<unk>"]}
"""Each family's special tokens, in its vocabulary order (XLM-RoBERTa: pad id 1, as its configs say)."""


def save_tiny_encoder(
    path: Path,
    kind: str,
    seed: int = 0,
    st_pooling: str | None = None,
    st_normalize: bool = True,
    st_layout: int = 5,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Save a seeded random encoder of ``kind`` and its tokenizer to ``path``; with ``st_pooling``
    ("cls", "mean", "lasttoken") also sentence-transformers' ``modules.json`` and
    ``1_Pooling/config.json`` (and a ``Normalize`` module when ``st_normalize``), the pooling config
    as sentence-transformers ``st_layout`` writes it (5: a flag per mode; 6: ``pooling_mode``). Returns
    the model."""
    family = kind.split("-")[0]
    config_class, model_class = KINDS[kind]
    settings = {**ENCODER_BASE, **({"pad_token_id": 1} if family == "xlmr" else {}), **overrides}
    if kind.endswith("cross"):
        settings["num_labels"] = 1
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(family, model.config.vocab_size).save_pretrained(path)
    if st_pooling is not None:
        _sentence_transformers_files(path, st_pooling, st_normalize, model.config.hidden_size, st_layout)
    return model


def _tokenizer(family: str, vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    specials = SPECIALS[family]
    words = specials + WORDS
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    vocab = {w: i for i, w in enumerate(words)}
    unk = "[UNK]" if family == "bert" else "<unk>"
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=unk))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if family == "bert":
        cls, sep, pad = "[CLS]", "[SEP]", "[PAD]"
        pair = f"{cls} $A:0 {sep}:0 $B:1 {sep}:1"
    else:
        cls, sep, pad = "<s>", "</s>", "<pad>"
        pair = f"{cls} $A {sep} {sep} $B {sep}"
    raw.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair, special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])]
    )
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if family == "bert" else ["input_ids", "attention_mask"]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, cls_token=cls, sep_token=sep, pad_token=pad, unk_token=unk, model_input_names=inputs
    )


def _sentence_transformers_files(path: Path, pooling: str, normalize: bool, hidden: int, layout: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    settings = {"word_embedding_dimension": hidden, **{mode: key == pooling for key, mode in modes.items()}}
    if layout >= 6:  # sentence-transformers 6 names the mode
        settings = {"embedding_dimension": hidden, "pooling_mode": pooling, "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
