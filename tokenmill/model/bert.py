"""BERT (``BertModel``: an embedder; ``BertForSequenceClassification``: a cross-encoder whose
logits are ``classifier(tanh(pooler.dense(h[CLS])))``). A classifier's checkpoint prefixes the
base model's tensors with ``bert.``."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.linear import Linear
from tokenmill.model.config import ModelConfig
from tokenmill.model.encoder import EncoderModel


class BertModel(EncoderModel):
    """The encoder alone (its checkpoint's ``pooler.*`` is not used: embeddings pool hidden states)."""


class BertForSequenceClassification(EncoderModel):
    checkpoint_module_names = {
        **EncoderModel.checkpoint_module_names,
        "embeddings": "bert.embeddings",
        "encoder": "bert.encoder",
        "pooler": "bert.pooler",
    }
    has_head = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.encoder is not None
        self.pooler = nn.Module()
        self.pooler.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.classifier = Linear(config.hidden_size, config.encoder.num_labels, bias=True)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(cls_rows)))
