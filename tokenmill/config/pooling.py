"""PoolingOptions: which runner the engine is (generation or pooling) and how pooling scores."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.options import option


@dataclass(frozen=True)
class PoolingOptions:
    """The pooling group of :class:`~tokenmill.config.EngineConfig`."""

    runner: str = option(
        "auto",
        '"generate" (completions, chat), "pooling" (embeddings, scores, reranking) or "auto": pooling for '
        "an encoder (BERT, XLM-RoBERTa), a *ForSequenceClassification checkpoint, a folder with "
        "sentence-transformers files (modules.json) or a set classifier_from_token; else generate. "
        "An engine serves its runner's requests only.",
        section="Pooling",
    )
    classifier_from_token: tuple[str, ...] = option(
        (),
        "A decoder as a reranker (the Qwen3-Reranker recipe): the two tokens NO,YES whose logits after "
        "the scoring prompt give a score (softmax over the pair: P(YES)); also read from config.json's "
        "classifier_from_token. Empty: scores come from the model's classification head.",
        section="Pooling",
        metavar="NO,YES",
        comma_separated=True,
    )
    score_template: str | None = option(
        None,
        'A decoder reranker\'s scoring prompt, with "{query}" and "{document}" (and optionally '
        '"{instruction}") in it, or "qwen3-reranker" for Qwen3-Reranker\'s own; None: the model\'s '
        'default ("qwen3-reranker" with classifier_from_token set).',
        section="Pooling",
    )
    max_score_documents: int = option(
        1000,
        "Most documents one score or rerank call may carry.",
        section="Pooling",
    )

    def __post_init__(self) -> None:
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f'runner must be "auto", "generate" or "pooling", got {self.runner!r}')
        tokens = self.classifier_from_token
        object.__setattr__(
            self, "classifier_from_token", tuple(tokens.split(",") if isinstance(tokens, str) else tokens)
        )
        if self.classifier_from_token and len(self.classifier_from_token) != 2:
            raise ValueError(f"classifier_from_token must name two tokens (NO,YES), got {self.classifier_from_token}")
        if self.max_score_documents < 1:
            raise ValueError(f"max_score_documents must be >= 1, got {self.max_score_documents}")
