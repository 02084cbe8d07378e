"""vLLM's ``/tokenize`` and ``/detokenize`` over HTTP, against the checkpoint's own Hugging Face
tokenizer and against what the generation routes count."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.server.conftest import MODEL, Server, serve
from tokenmill import Engine

MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(checkpoint)


def rendered(hf: PreTrainedTokenizerBase, add_generation_prompt: bool) -> list[int]:
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    return hf.encode(text, add_special_tokens=False)


def post(server: Server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kwargs)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_a_prompt_as_the_tokenizer_does(server: Server, hf: PreTrainedTokenizerBase) -> None:
    text = "the cat sat on the mat"
    max_model_len = ok(httpx.get(f"{server.url}/v1/models"))["data"][0]["max_model_len"]
    reply = ok(post(server, "/tokenize", {"model": MODEL, "prompt": text}))
    assert reply == {"tokens": hf.encode(text), "count": len(hf.encode(text)), "max_model_len": max_model_len}
    plain = ok(post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}))  # model may be left out
    assert plain["tokens"] == hf.encode(text, add_special_tokens=False)
    completion = ok(post(server, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}))
    assert completion["usage"]["prompt_tokens"] == reply["count"]


def test_tokenize_messages_as_the_chat_route_renders_them(server: Server, hf: PreTrainedTokenizerBase) -> None:
    reply = ok(post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}))
    assert reply["tokens"] == rendered(hf, add_generation_prompt=True)
    chat = ok(post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}))
    assert chat["usage"]["prompt_tokens"] == reply["count"]
    bare = ok(post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False}))
    assert bare["tokens"] == rendered(hf, add_generation_prompt=False)
    assert bare["count"] < reply["count"]


def test_detokenize_inverts_tokenize(server: Server, hf: PreTrainedTokenizerBase) -> None:
    for body in ({"prompt": "hello world"}, {"messages": MESSAGES}):
        tokens = ok(post(server, "/tokenize", {"model": MODEL, **body}))["tokens"]
        text = ok(post(server, "/detokenize", {"model": MODEL, "tokens": tokens}))["prompt"]
        assert text == hf.decode(tokens, skip_special_tokens=False)
        assert ok(post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"] == tokens
    assert ok(post(server, "/detokenize", {"tokens": []})) == {"prompt": ""}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "hi", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
        ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/detokenize", {"model": MODEL, "tokens": [5, 100000]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [5]}, 404, "model"),
    ],
)
def test_bad_requests_get_the_openai_error_shape(
    server: Server, path: str, body: dict, status: int, param: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_a_prompt_longer_than_the_context_is_counted(server: Server, hf: PreTrainedTokenizerBase) -> None:
    """As in vLLM: tokenizing checks no context limit (the body size limit bounds the work)."""
    text = "hello " * 2000
    reply = ok(post(server, "/tokenize", {"model": MODEL, "prompt": text}))
    assert reply["count"] == len(hf.encode(text)) > reply["max_model_len"]


@pytest.fixture(scope="module")
def guarded(checkpoint: Path) -> Iterator[Server]:
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=256), api_key="k3y") as live:
        yield live


def test_the_api_key_is_required(guarded: Server) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert post(guarded, path, body).status_code == 401
        assert post(guarded, path, body, headers={"Authorization": "Bearer k3y"}).status_code == 200
