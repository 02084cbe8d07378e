"""PoolingParams, a request for the prompt's embedding or score instead of generated tokens, and
ScorePair, a scoring request's prompt."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.request.checks import is_int, require


@dataclass
class PoolingParams:
    """A pooling request: the prompt's embedding, or its score, instead of generated tokens.

    ``task`` "embed": ``pooling`` "cls" (the first token's final hidden state), "last" (the last
    token's, after the final norm: the Qwen3-Embedding recipe) or "mean" (over every prompt
    position); ``dimensions``: keep the first ``d`` values (Matryoshka), then ``normalize`` (L2).
    None for ``pooling`` / ``normalize``: the model's own (its sentence-transformers files, else
    "cls" for an encoder, "last" for a decoder; normalized). ``task`` "score": the prompt is a
    :class:`ScorePair` and the result one relevance score from the model's classification head or
    its ``classifier_from_token`` pair; ``pooling``, ``normalize`` and ``dimensions`` do not apply.
    ``truncate_prompt_tokens``: cut a longer prompt to ``k`` tokens (a decoder's last ones, an
    encoder's text as its tokenizer truncates it); None: a prompt over the limit is refused."""

    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"

    def validate(self, hidden_size: int, context_limit: int) -> None:
        """Raise :class:`ParameterError` naming the first bad parameter."""
        keep = self.truncate_prompt_tokens
        require(
            keep is None or (is_int(keep) and 1 <= keep <= context_limit),
            "truncate_prompt_tokens",
            f"must be an integer in [1, {context_limit}] (the context limit) or None, got {keep!r}",
        )
        require(self.task in ("embed", "score"), "task", f'must be "embed" or "score", got {self.task!r}')
        require(
            self.pooling in (None, "cls", "last", "mean"),
            "pooling",
            f'must be "cls", "last", "mean" or None, got {self.pooling!r}',
        )
        require(self.normalize in (None, True, False), "normalize", f"must be a boolean, got {self.normalize!r}")
        dims = self.dimensions
        require(dims is None or is_int(dims), "dimensions", f"must be an integer or None, got {dims!r}")
        require(
            dims is None or 1 <= dims <= hidden_size,
            "dimensions",
            f"must be in [1, {hidden_size}] (the model's hidden size), got {dims}",
        )
        if self.task == "score":
            for name in ("pooling", "normalize", "dimensions"):
                require(getattr(self, name) is None, name, "does not apply to scoring (task 'score')")


@dataclass(frozen=True)
class ScorePair:
    """The prompt of a scoring request: how relevant ``document`` is to ``query``; ``instruction``
    fills a decoder reranker's template (None: the template's default)."""

    query: str
    document: str
    instruction: str | None = None
