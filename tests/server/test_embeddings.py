"""``POST /v1/embeddings`` through the official ``openai`` client and httpx, against transformers'
final hidden states of the served checkpoint (a decoder served with runner "pooling"): float and
base64 (decoded by the client, and by hand), ``dimensions``, token-id input, usage, 400s naming the
parameter, each runner's routes refused by the other, the API key and overload."""

from __future__ import annotations

import base64
import struct
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.embedding_checks import assert_embedding_close
from tests.server.conftest import MODEL, Server, serve
from tokenmill import Engine

KEY = "sk-embed"


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Server:
    with serve(Engine(dtype="float32", model=str(checkpoint), runner="pooling", num_kv_slots=8192)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()


def oracle(hf_model, ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    """Last-token pooling of transformers' final-normed hidden states, cut, L2-normalized."""
    with torch.no_grad():
        last = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(last[:dimensions] if dimensions else last, dim=0)


def post(server: Server, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60, **kwargs)


def test_float_embeddings_of_strings_with_usage(client: openai.OpenAI, server: Server, hf_model) -> None:
    texts = ["hello world", "the cat sat on the mat"]
    reply = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ids = [server.engine.tokenizer.encode(t) for t in texts]
    assert reply.object == "list" and reply.model == MODEL
    assert [d.index for d in reply.data] == [0, 1] and all(d.object == "embedding" for d in reply.data)
    for data, prompt in zip(reply.data, ids):
        assert_embedding_close(data.embedding, oracle(hf_model, prompt))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(p) for p in ids)


def test_base64_decoded_by_the_client_and_by_hand(client: openai.OpenAI, server: Server, hf_model) -> None:
    ids = server.engine.tokenizer.encode("hello world")
    default = client.embeddings.create(model=MODEL, input="hello world")  # the client asks base64 and decodes it
    assert_embedding_close(default.data[0].embedding, oracle(hf_model, ids))
    raw = post(server, {"model": MODEL, "input": "hello world", "encoding_format": "base64"})
    assert raw.status_code == 200, raw.text
    encoded = raw.json()["data"][0]["embedding"]
    blob = base64.b64decode(encoded)
    assert len(blob) == 4 * 64
    assert_embedding_close(list(struct.unpack("<64f", blob)), oracle(hf_model, ids))
    floats = post(server, {"model": MODEL, "input": "hello world"}).json()["data"][0]["embedding"]
    assert isinstance(floats, list) and list(struct.unpack("<64f", blob)) == pytest.approx(floats, abs=1e-7)


def test_dimensions_and_token_id_inputs(client: openai.OpenAI, hf_model) -> None:
    one = client.embeddings.create(model=MODEL, input=[5, 17, 33, 2], dimensions=8, encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 8
    assert_embedding_close(one.data[0].embedding, oracle(hf_model, [5, 17, 33, 2], dimensions=8))
    assert one.usage.prompt_tokens == 4
    many = client.embeddings.create(model=MODEL, input=[[5, 17, 33, 2], [9, 4, 71]], encoding_format="float")
    assert_embedding_close(many.data[1].embedding, oracle(hf_model, [9, 4, 71]))
    assert many.usage.total_tokens == 7


def test_truncate_prompt_tokens_embeds_each_inputs_last_tokens(server: Server, hf_model) -> None:
    long = [(7 * i) % 90 + 4 for i in range(600)]  # over the context limit: refused whole
    body = {"model": MODEL, "input": [long, [9, 4, 71]], "encoding_format": "float", "truncate_prompt_tokens": 16}
    reply = post(server, body).json()
    assert_embedding_close(reply["data"][0]["embedding"], oracle(hf_model, long[-16:]))
    assert_embedding_close(reply["data"][1]["embedding"], oracle(hf_model, [9, 4, 71]))
    assert reply["usage"]["prompt_tokens"] == 16 + 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["hello", ""]}, "input"),
        ({"input": [[5, 6], []]}, "input"),
        ({"input": [500]}, "input"),  # outside the vocabulary
        ({"input": [5] * 600}, "input"),  # longer than the context
        ({"input": "hello", "dimensions": 0}, "dimensions"),
        ({"input": "hello", "dimensions": 65}, "dimensions"),
        ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(server: Server, body: dict, param: str) -> None:
    free = server.engine.stats()["kv_free_pages"]
    response = post(server, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert server.engine.stats()["kv_free_pages"] == free


def test_unknown_model_is_a_404(server: Server) -> None:
    response = post(server, {"model": "other", "input": "hello"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_each_runner_refuses_the_others_routes(server: Server, checkpoint: Path) -> None:
    """A pooling server refuses generation (400 naming ``model``); a generating server of the same
    checkpoint refuses embeddings the same way."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    assert "--runner generate" in refused.json()["error"]["message"]
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=1024)) as generating:
        refused = post(generating, {"model": MODEL, "input": "hello"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        assert "--runner pooling" in refused.json()["error"]["message"]
        assert httpx.post(f"{generating.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200


def test_api_key_and_overload(checkpoint: Path) -> None:
    engine = Engine(dtype="float32", model=str(checkpoint), runner="pooling", num_kv_slots=1024, max_waiting_requests=1)
    with serve(engine, api_key=KEY) as live:
        body = {"model": MODEL, "input": "hello world"}
        assert post(live, body).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert post(live, body, headers=auth).status_code == 200
        engine.pause_generation()
        first: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: first.append(post(live, body, headers=auth)))
        waiting.start()
        deadline = time.monotonic() + 30
        while engine.stats()["waiting"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = post(live, body, headers=auth)
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        engine.resume_generation()
        waiting.join(60)
        assert first[0].status_code == 200
