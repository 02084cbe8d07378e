"""XLM-RoBERTa (``XLMRobertaModel``: an embedder, e.g. bge-m3 and multilingual-e5;
``XLMRobertaForSequenceClassification``: a cross-encoder, e.g. bge-reranker, whose logits are
``classifier.out_proj(tanh(classifier.dense(h[CLS])))``). Positions start after the padding index
(``pad_token_id + 1``), as RoBERTa's do; a classifier's checkpoint prefixes the base model's
tensors with ``roberta.``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.kernels.linear import Linear
from tokenmill.model.config import ModelConfig
from tokenmill.model.encoder import EncoderModel


class XLMRobertaModel(EncoderModel):
    @classmethod
    def position_offset_of(cls, raw: dict[str, Any]) -> int:
        return int(raw.get("pad_token_id", 1)) + 1


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    checkpoint_module_names = {
        **EncoderModel.checkpoint_module_names,
        "embeddings": "roberta.embeddings",
        "encoder": "roberta.encoder",
    }
    has_head = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.encoder is not None
        self.classifier = nn.Module()
        self.classifier.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.classifier.out_proj = Linear(config.hidden_size, config.encoder.num_labels, bias=True)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(cls_rows)))
