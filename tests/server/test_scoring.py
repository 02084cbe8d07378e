"""``POST /score``, ``/rerank`` (and ``/v1/rerank``, ``/v2/rerank``) through httpx and
``/v1/embeddings`` through the official ``openai`` client, on encoder servers started the real way:
a BERT cross-encoder's scores against transformers' ``sigmoid(logits)`` of each pair, results sorted
with their index and text, ``top_n`` and ``return_documents``, Cohere's document objects; a
sentence-transformers BERT embedder's embeddings (its own CLS pooling and normalization) and its
cosine-similarity scores; 400s naming the parameter with nothing allocated."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.server.conftest import Server, serve
from tests.tiny_encoders import save_tiny_encoder
from tokenmill import Engine

QUERY = "hello world"
DOCS = ["the cat sat on the mat", "two three", "hello world is here", "the dog and the cat"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    path = tmp_path_factory.mktemp("cross") / "tiny-cross"
    return path, save_tiny_encoder(path, "bert-cross", seed=3)


@pytest.fixture(scope="module")
def reranker(cross_encoder) -> Server:
    engine = Engine(model=str(cross_encoder[0]), dtype="float32", num_kv_slots=1024, max_score_documents=8)
    with serve(engine) as live:
        yield live


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Server, transformers.PreTrainedModel]:
    path = tmp_path_factory.mktemp("embedder") / "tiny-embedder"
    hf_model = save_tiny_encoder(path, "bert", seed=4, st_pooling="cls")
    with serve(Engine(model=str(path), dtype="float32", num_kv_slots=1024)) as live:
        yield live, hf_model


def pair_score(cross_encoder, query: str, document: str) -> float:
    path, hf_model = cross_encoder
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return torch.sigmoid(hf_model(**tokenizer(query, document, return_tensors="pt")).logits[0, 0]).item()


def post(server: Server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


def test_score_equals_the_cross_encoder_in_document_order(reranker: Server, cross_encoder) -> None:
    reply = post(reranker, "/score", {"model": "tiny-cross", "text_1": QUERY, "text_2": DOCS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "tiny-cross"
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    for data, doc in zip(body["data"], DOCS):
        assert data["object"] == "score" and data["score"] == pytest.approx(
            pair_score(cross_encoder, QUERY, doc), abs=1e-5
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder[0])
    tokens = sum(len(tokenizer(QUERY, doc)["input_ids"]) for doc in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    one = post(reranker, "/v1/score", {"model": "tiny-cross", "text_1": [QUERY], "text_2": DOCS[0]}).json()
    assert one["data"][0]["score"] == pytest.approx(body["data"][0]["score"], abs=1e-6)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance_with_top_n_and_documents(reranker: Server, cross_encoder, route: str) -> None:
    expected = sorted(((pair_score(cross_encoder, QUERY, d), i) for i, d in enumerate(DOCS)), key=lambda x: -x[0])
    body = {"model": "tiny-cross", "query": QUERY, "documents": DOCS, "top_n": 3}
    results = post(reranker, route, body).json()["results"]
    assert [r["index"] for r in results] == [i for _, i in expected[:3]]
    for result, (score, i) in zip(results, expected):
        assert result["relevance_score"] == pytest.approx(score, abs=1e-5)
        assert result["document"] == {"text": DOCS[i]}
    objects = {**body, "documents": [{"text": d} for d in DOCS], "return_documents": False, "top_n": None}
    bare = post(reranker, route, objects).json()["results"]
    assert [r["index"] for r in bare] == [i for _, i in expected] and all("document" not in r for r in bare)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/rerank", {"query": "", "documents": DOCS}, "query"),
        ("/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/rerank", {"query": QUERY, "documents": ["the cat", ""]}, "documents"),
        ("/rerank", {"query": QUERY, "documents": ["the cat"] * 9}, "documents"),  # over max_score_documents
        ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
        ("/rerank", {"query": QUERY, "documents": ["the cat " * 100]}, "documents"),  # over the 128 positions
        ("/rerank", {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_1"),
        ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/v1/embeddings", {"input": "hello"}, "task"),  # a cross-encoder scores, it does not embed
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/v1/completions", {"prompt": "hi"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(reranker: Server, route: str, body: dict, param: str) -> None:
    free = reranker.engine.stats()["kv_free_pages"]
    response = post(reranker, route, {"model": "tiny-cross", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["message"]
    assert reranker.engine.stats()["kv_free_pages"] == free


def test_truncated_documents_score_as_the_tokenizer_cuts_them(reranker: Server, cross_encoder) -> None:
    long = "the cat sat " * 60
    body = {"model": "tiny-cross", "query": QUERY, "documents": [long], "truncate_prompt_tokens": 40}
    result = post(reranker, "/rerank", body).json()["results"][0]
    path, hf_model = cross_encoder
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        cut = tokenizer(QUERY, long, truncation=True, max_length=40, return_tensors="pt")
        expected = torch.sigmoid(hf_model(**cut).logits[0, 0]).item()
    assert result["relevance_score"] == pytest.approx(expected, abs=1e-5)


def test_embedder_serves_openai_embeddings_and_similarity_scores(embedder) -> None:
    server, hf_model = embedder
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(server.engine.config.model)
    texts = [QUERY, *DOCS]
    reply = client.embeddings.create(model="tiny-embedder", input=texts, encoding_format="float")
    with torch.no_grad():
        expected = [
            torch.nn.functional.normalize(hf_model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0], dim=0)
            for t in texts
        ]
    for data, vector in zip(reply.data, expected):
        torch.testing.assert_close(torch.tensor(data.embedding), vector, atol=1e-4, rtol=0)
    scores = post(server, "/score", {"model": "tiny-embedder", "text_1": QUERY, "text_2": DOCS}).json()["data"]
    for data, vector in zip(scores, expected[1:]):
        assert data["score"] == pytest.approx(float(expected[0] @ vector), abs=1e-5)


def test_status_health_and_metrics_of_a_pooling_server(reranker: Server) -> None:
    status = httpx.get(f"{reranker.url}/status", timeout=30).json()
    assert status["runner"] == "pooling" and status["attention_backend"] == "none (encoder)"
    assert httpx.get(f"{reranker.url}/health", timeout=30).status_code == 200
    assert "tokenmill_" in httpx.get(f"{reranker.url}/metrics", timeout=30).text
