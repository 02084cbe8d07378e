"""Query-document scoring: vLLM's ``POST /score`` (and ``/v1/score``) and the Jina / Cohere shaped
``POST /rerank`` (and ``/v1/rerank``, ``/v2/rerank``), on a pooling model (runner "pooling").

One query against up to ``max_score_documents`` documents: a cross-encoder's or decoder
reranker's score of each pair, or an embedder's cosine similarity (``engine/scoring.py``); every
pair is validated before any is queued, and the requests run through the scheduler as any others
(budget, limits, 429 when the queue is full). ``/score`` answers in document order; ``/rerank``
sorts by ``relevance_score`` (highest first), keeps ``top_n``, and returns each document's text
unless ``return_documents`` is false. ``usage`` counts each request's prompt tokens once.
Refusals name the parameter: ``query`` / ``text_1``, ``documents`` / ``text_2``, ``top_n``,
``truncate_prompt_tokens``, ``model``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.engine.scoring import check_documents, rerank, score_outputs, score_requests
from tokenmill.metrics import RequestTracker
from tokenmill.request import ParameterError, ScoringRequestOutput
from tokenmill.server.http.errors import APIError, engine_errors
from tokenmill.server.http.json_body import json_response
from tokenmill.server.http.state import State, check_unicode
from tokenmill.server.openai.output import raise_on_error
from tokenmill.server.openai.protocol import RerankRequest, ScoreRequest
from tokenmill.server.shared.generation import until_disconnected

router = APIRouter()


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request, state: State) -> Response:
    queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    if len(queries) != 1:
        raise APIError(400, f"text_1 must be one text (the query), got {len(queries)}", param="text_1")
    aliases = {"query": "text_1", "documents": "text_2", "prompt": "text_2"}
    scored, usage = await _score(
        state, request, body.model, queries[0], body.text_2, body.truncate_prompt_tokens, aliases
    )
    data = [{"index": i, "object": "score", "score": result.outputs.score} for i, result in enumerate(scored)]
    reply = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": state.model_name,
        "data": data,
        "usage": usage,
    }
    return await json_response(reply)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank_documents(body: RerankRequest, request: Request, state: State) -> Response:
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    aliases = {"prompt": "documents"}
    with engine_errors(aliases):
        rerank([], [], body.top_n)  # refuses a bad top_n before anything runs
    scored, usage = await _score(
        state, request, body.model, body.query, documents, body.truncate_prompt_tokens, aliases
    )
    ranked = rerank([result.outputs.score for result in scored], documents, body.top_n)
    results = [
        {
            "index": r.index,
            "relevance_score": r.score,
            **({"document": {"text": r.document}} if body.return_documents else {}),
        }
        for r in ranked
    ]
    reply = {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name, "results": results, "usage": usage}
    return await json_response(reply)


async def _score(
    state: State,
    request: Request,
    model: str,
    query: str,
    documents: Any,
    truncate_prompt_tokens: int | None,
    aliases: dict[str, str],
) -> tuple[list[ScoringRequestOutput], dict[str, int]]:
    """Each document's score (in order) and the call's usage; 400s naming the parameter."""
    arrival = time.monotonic()
    state.check_model(model, adapters=False, runner="pooling")
    pooling = state.engine.pooling
    assert pooling is not None, "a pooling engine has its pooling defaults"
    with engine_errors(aliases):
        docs = check_documents(documents, state.engine.config.max_score_documents)
        check_unicode([query, *docs], aliases.get("prompt", "documents"))
        prompts, params = score_requests(pooling, query, docs, None, truncate_prompt_tokens)
        if len(prompts) > max(1, state.engine.config.max_waiting_requests):
            raise ParameterError(
                "documents", f"needs {len(prompts)} requests; one call may queue at most max_waiting_requests"
            )
        outputs = await until_disconnected(
            request, state.async_engine.pool(prompts, params, f"score-{uuid.uuid4().hex}")
        )
    for output in outputs:
        raise_on_error(output)
        tracker = RequestTracker(state.metrics, arrival, len(output.prompt_token_ids), 1)
        tracker.observe(output)
        tracker.close()
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return score_outputs(pooling, outputs), {"prompt_tokens": tokens, "total_tokens": tokens}
