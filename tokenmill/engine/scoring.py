"""Score and rerank calls: one query against documents, as the model scores pairs.

A cross-encoder or a decoder reranker (``PoolingConfig.scores`` "head" / "tokens") scores each
pair in one request (:class:`~tokenmill.request.ScorePair`, ``PoolingParams(task="score")``); an
embedder embeds the query and every document (normalized) and the score of a document is the
cosine similarity of the two embeddings, as vLLM's ``/score`` does for embedding models. Every
request of a call goes through the engine like any other (budget, limits). A reranking is the
scores sorted highest first (ties: the earlier document first), cut to ``top_n``.
"""

from __future__ import annotations

from tokenmill.model.pooling_config import PoolingConfig
from tokenmill.request import (
    ParameterError,
    PoolingParams,
    RequestOutput,
    RerankResult,
    ScorePair,
    ScoringOutput,
    ScoringRequestOutput,
)


def check_documents(documents: object, cap: int, name: str = "documents") -> list[str]:
    """``documents`` as a list of 1 .. ``cap`` non-empty strings (one string: a list of it);
    ParameterError naming ``name`` otherwise."""
    docs = [documents] if isinstance(documents, str) else documents
    if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
        raise ParameterError(name, "must be a string or a list of strings")
    if not docs:
        raise ParameterError(name, "is empty")
    if len(docs) > cap:
        raise ParameterError(
            name, f"holds {len(docs)} documents; one call may hold at most {cap} (max_score_documents)"
        )
    empty = [i for i, d in enumerate(docs) if not d]
    if empty:
        raise ParameterError(name, f"document(s) {empty[:5]} are empty")
    return docs


def score_requests(
    pooling: PoolingConfig,
    query: str,
    documents: list[str],
    instruction: str | None = None,
    truncate_prompt_tokens: int | None = None,
) -> tuple[list[str] | list[ScorePair], PoolingParams]:
    """The engine prompts of one score call and their parameters: a pair per document, or (an
    embedder) the query then every document."""
    if not isinstance(query, str) or not query:
        raise ParameterError("query", "must be a non-empty string")
    keep = truncate_prompt_tokens
    if pooling.scores == "similarity":
        return [query, *documents], PoolingParams(normalize=True, truncate_prompt_tokens=keep)
    pairs = [ScorePair(query, doc, instruction) for doc in documents]
    return pairs, PoolingParams(task="score", truncate_prompt_tokens=keep)


def score_outputs(pooling: PoolingConfig, outputs: list[RequestOutput]) -> list[ScoringRequestOutput]:
    """Each document's result from the final outputs of :func:`score_requests`' prompts."""
    if pooling.scores != "similarity":
        return [ScoringRequestOutput.from_output(output) for output in outputs]
    query, docs = outputs[0], outputs[1:]
    results = []
    for doc in docs:
        failed = next((o for o in (query, doc) if o.outputs[0].error is not None or o.embedding is None), None)
        if failed is not None:
            result = ScoringRequestOutput.from_output(failed)
            result.request_id = doc.request_id
        else:
            assert query.embedding is not None and doc.embedding is not None
            similarity = sum(a * b for a, b in zip(query.embedding, doc.embedding))
            result = ScoringRequestOutput(doc.request_id, doc.prompt_token_ids, ScoringOutput(similarity), True, "stop")
        results.append(result)
    return results


def rerank(scores: list[float], documents: list[str], top_n: int | None = None) -> list[RerankResult]:
    """The documents by score, highest first (stable), the first ``top_n`` (None: all)."""
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise ParameterError("top_n", f"must be a positive integer, got {top_n!r}")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [RerankResult(i, scores[i], documents[i]) for i in order[:top_n]]
