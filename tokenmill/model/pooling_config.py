"""What a checkpoint folder says about pooling: whether it is a pooling model (the ``runner``), how
its embeddings pool (sentence-transformers' ``modules.json``, ``1_Pooling/config.json`` and a
``Normalize`` module), and how it scores a query-document pair.

Scoring, one of three ways (:attr:`PoolingConfig.scores`):
- "head": an encoder's classification head of one label, on the CLS row (a cross-encoder;
  the score is the sigmoid of its logit, as sentence-transformers' ``CrossEncoder`` gives);
- "tokens": a decoder's logits of a token pair ``(no, yes)`` after the scoring prompt (the
  Qwen3-Reranker recipe; the score is ``softmax(no, yes)[yes]``), the pair from
  ``classifier_from_token`` (the engine's option, else config.json's);
- "similarity": an embedder, the cosine similarity of the query's and the document's embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.model.config import ModelConfig, ModelConfigError, read_config_json
from tokenmill.tokenizer import Tokenizer

QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
"""Qwen3-Reranker's scoring prompt (its model card's)."""

TEMPLATES = {"qwen3-reranker": QWEN3_RERANKER_TEMPLATE}
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""``{instruction}`` when a scoring request gives none (Qwen3-Reranker's default)."""

ST_POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
"""sentence-transformers' pooling flags (the layout before version 6: one boolean key per mode)."""
ST6_POOLING_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
"""sentence-transformers 6's ``pooling_mode`` values we pool by (it also has "max",
"mean_sqrt_len_tokens" and "weightedmean", refused); a list of several modes concatenates them, refused."""


@dataclass(frozen=True)
class PoolingConfig:
    """A pooling model's defaults: ``pooling`` ("cls", "mean", "last") and ``normalize`` of its
    embeddings, how it ``scores`` (see the module), the ``score_tokens`` pair and ``score_template``
    of a "tokens" scorer, and ``num_labels`` of a "head" (0 without one)."""

    pooling: str
    normalize: bool
    scores: str
    score_tokens: tuple[str, str] | None = None
    score_template: str | None = None
    num_labels: int = 0

    def score_token_ids(self, tokenizer: Tokenizer | None) -> tuple[int, int] | None:
        """The vocabulary ids of a "tokens" scorer's ``(no, yes)`` (None for another scorer);
        ModelConfigError naming a token the vocabulary lacks."""
        if self.score_tokens is None:
            return None
        if tokenizer is None:
            raise ModelConfigError("classifier_from_token needs the tokenizer")
        no, yes = (tokenizer.token_id(token) for token in self.score_tokens)
        if no is None or yes is None:
            raise ModelConfigError(f"classifier_from_token: {self.score_tokens} are not both tokens of the vocabulary")
        return no, yes

    def format_score_prompt(self, query: str, document: str, instruction: str | None) -> str:
        """A "tokens" scorer's prompt of one pair."""
        assert self.score_template is not None, "a token-pair scorer has a template"
        fields = {"query": query, "document": document, "instruction": instruction or DEFAULT_INSTRUCTION}
        return self.score_template.format_map(fields)


def resolve_runner(
    requested: str, path: str | Path, model_config: ModelConfig, classifier_from_token: tuple[str, ...]
) -> str:
    """ "generate" or "pooling" for the checkpoint at ``path`` (``requested`` "auto": see the
    ``runner`` option); raises ModelConfigError for an encoder asked to generate."""
    is_encoder = model_config.encoder is not None
    if requested == "generate" and is_encoder:
        raise ModelConfigError(f"{model_config.architecture} is an encoder: it runs with runner 'pooling' only")
    if requested != "auto":
        return requested
    raw, _ = read_config_json(path)
    pooling = (
        is_encoder
        or model_config.architecture.endswith("ForSequenceClassification")
        or (Path(path) / "modules.json").is_file()
        or bool(classifier_from_token or raw.get("classifier_from_token"))
    )
    return "pooling" if pooling else "generate"


def pooling_config(
    path: str | Path,
    model_config: ModelConfig,
    classifier_from_token: tuple[str, ...] = (),
    score_template: str | None = None,
) -> PoolingConfig:
    """The pooling defaults of the checkpoint at ``path``; ModelConfigError for a
    sentence-transformers pooling mode not supported, a token pair that is not two tokens, or a
    template without its fields."""
    folder = Path(path)
    encoder = model_config.encoder
    pooling, normalize = _sentence_transformers(folder) or ("cls" if encoder is not None else "last", True)
    raw, source = read_config_json(folder)
    tokens = tuple(classifier_from_token or raw.get("classifier_from_token") or ())
    if tokens:
        if encoder is not None or len(tokens) != 2 or not all(isinstance(t, str) for t in tokens):
            raise ModelConfigError(f"{source}: classifier_from_token needs a decoder and two tokens, got {tokens!r}")
        template = TEMPLATES.get(score_template or "qwen3-reranker", score_template)
        assert template is not None
        for field in ("{query}", "{document}"):
            if field not in template:
                raise ModelConfigError(f"score_template must contain {field}")
        return PoolingConfig(pooling, normalize, "tokens", (tokens[0], tokens[1]), template)
    if encoder is not None and model_config.architecture.endswith("ForSequenceClassification"):
        return PoolingConfig(pooling, normalize, "head", num_labels=encoder.num_labels)
    return PoolingConfig(pooling, normalize, "similarity")


def _sentence_transformers(folder: Path) -> tuple[str, bool] | None:
    """``(pooling, normalize)`` from a sentence-transformers folder's modules; None without one."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    pooling = None
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config_file = folder / str(module.get("path", "")) / "config.json"
            settings: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
            if "pooling_mode" in settings:  # sentence-transformers 6: {"pooling_mode": "mean" or a list, ...}
                pooling = _st6_pooling(settings["pooling_mode"], config_file)
                continue
            unsupported = [mode for mode in ST_UNSUPPORTED_MODES if settings.get(mode)]
            chosen = [value for key, value in ST_POOLING_MODES.items() if settings.get(key)]
            if unsupported or len(chosen) != 1:
                modes = unsupported + [k for k in ST_POOLING_MODES if settings.get(k)]
                raise ModelConfigError(
                    f"{config_file}: pooling modes {modes or 'none'}; supported: exactly one of "
                    f"{', '.join(ST_POOLING_MODES)}"
                )
            pooling = chosen[0]
    normalize = any(str(module.get("type", "")).endswith("Normalize") for module in modules)
    return (pooling or "mean", normalize)


def _st6_pooling(mode: Any, config_file: Path) -> str:
    """The pooling of a sentence-transformers 6 ``pooling_mode`` (a mode, or a list of one)."""
    modes = mode if isinstance(mode, list) else [mode]
    if len(modes) != 1 or modes[0] not in ST6_POOLING_MODES:
        raise ModelConfigError(
            f"{config_file}: pooling_mode {mode!r}; supported: exactly one of {', '.join(ST6_POOLING_MODES)}"
        )
    return ST6_POOLING_MODES[modes[0]]
