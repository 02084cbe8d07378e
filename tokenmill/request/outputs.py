"""A request's results: RequestOutput (with its CompletionOutputs, Logprobs and RequestMetrics) as
streamed to the caller's OutputCallback and folded by :func:`accumulate`, FinishReason, and a
pooling request's results (EmbeddingRequestOutput, ScoringRequestOutput, RerankResult)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (e.g. the client went away)
    ERROR = "error"  # the engine failed this request; ``CompletionOutput.error`` says why


LOGPROB_FLOOR = -9999.0
"""The lowest logprob reported: -inf (a zero probability) and NaN (non-finite logits, e.g. after a
bad weight update) read as this, so a logprob is always a number JSON can carry."""


@dataclass
class Logprob:
    """Log-probability of one token, with its rank (1 = most likely) under the model; always finite:
    at least :data:`LOGPROB_FLOOR` (what a zero probability or a non-finite model output reads as)."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request. In a streamed delta, text/token_ids are the new part."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    weight_versions: list[int] = field(default_factory=list)  # weight version that produced each token
    lora_versions: list[int] = field(default_factory=list)  # with a LoRA adapter: its version for each token

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's final delta (see PoolingParams)
    score: float | None = None  # a scoring request's final delta (PoolingParams.task "score")


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """A pooling request's result (vLLM's names); ``finish_reason`` "stop", or "abort"/"error"
    (then ``error`` says why and the embedding is empty)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    finish_reason: str | None = None
    error: str | None = None

    @staticmethod
    def from_output(output: RequestOutput) -> EmbeddingRequestOutput:
        """The final delta of a pooling request as its result."""
        completion = output.outputs[0]
        return EmbeddingRequestOutput(
            request_id=output.request_id,
            prompt_token_ids=output.prompt_token_ids,
            outputs=EmbeddingOutput(output.embedding or []),
            finished=output.finished,
            finish_reason=completion.finish_reason,
            error=completion.error,
        )


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """A scoring request's result (vLLM's names); ``finish_reason`` "stop", or "abort"/"error"
    (then ``error`` says why and the score is NaN)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
    finish_reason: str | None = None
    error: str | None = None

    @staticmethod
    def from_output(output: RequestOutput) -> ScoringRequestOutput:
        """The final delta of a scoring request as its result."""
        completion = output.outputs[0]
        return ScoringRequestOutput(
            request_id=output.request_id,
            prompt_token_ids=output.prompt_token_ids,
            outputs=ScoringOutput(float("nan") if output.score is None else output.score),
            finished=output.finished,
            finish_reason=completion.finish_reason,
            error=completion.error,
        )


@dataclass(frozen=True)
class RerankResult:
    """One document of a reranking: its index in the call's documents, its score and its text."""

    index: int
    score: float
    document: str


OutputCallback = Callable[[RequestOutput], None]


def now() -> float:
    """The clock of :class:`RequestMetrics` (monotonic seconds)."""
    return time.monotonic()


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a streamed delta into the cumulative output of a request (returns the new total)."""
    if total is None:
        total = RequestOutput(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[],
            finished=False,
            metrics=delta.metrics,
            prompt_logprobs=delta.prompt_logprobs,
            num_cached_tokens=delta.num_cached_tokens,
        )
    by_index = {c.index: c for c in total.outputs}
    for part in delta.outputs:
        acc = by_index.get(part.index)
        if acc is None:
            acc = by_index[part.index] = CompletionOutput(
                index=part.index, logprobs=[] if part.logprobs is not None else None
            )
        acc.text += part.text
        acc.token_ids += part.token_ids
        acc.weight_versions += part.weight_versions
        acc.lora_versions += part.lora_versions
        if part.logprobs is not None and acc.logprobs is not None:
            acc.logprobs += part.logprobs
        acc.finish_reason, acc.stop_reason, acc.error = part.finish_reason, part.stop_reason, part.error
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.metrics = delta.metrics
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    if delta.embedding is not None:
        total.embedding = delta.embedding
    if delta.score is not None:
        total.score = delta.score
    return total
