"""The error table over raw HTTP: every refusal has the right status, shape and ``param``, reaches
the engine only when it should, and leaves the server serving."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL, Server, serve, wait_until_idle
from tokenmill import Engine

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
KEY = "s3cret-key"


def post(server: Server, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kwargs)


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_still_serves(server: Server, **kwargs) -> None:
    response = post(server, "/v1/chat/completions", CHAT, **kwargs)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "path, change, param",
    [
        ("/v1/chat/completions", {"temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"n": 17}, "n"),  # EngineConfig.max_n
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": 401}, "max_tokens"),  # EngineConfig.max_tokens_cap
        ("/v1/chat/completions", {"max_completion_tokens": 401}, "max_tokens"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),  # max_top_logprobs
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
        ("/v1/chat/completions", {"stop": [f"s{i}" for i in range(17)]}, "stop"),  # max_stop_strings
        ("/v1/chat/completions", {"stop": [""]}, "stop"),
        ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {"min_p": 2}, "min_p"),
        ("/v1/chat/completions", {"stop_token_ids": [100000]}, "stop_token_ids"),
        ("/v1/chat/completions", {"seed": "x"}, "seed"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [5, 100000]}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_parameters_are_400_naming_the_param(server: Server, path: str, change: dict, param: str) -> None:
    steps = server.engine.stats()["scheduler"]["steps"]
    base = CHAT if path == "/v1/chat/completions" else COMPLETION
    error = openai_error(post(server, path, {**base, **change}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert server.engine.stats()["scheduler"]["steps"] == steps  # refused before any engine work


def test_one_bad_prompt_refuses_the_whole_call_and_aborts_the_others(server: Server) -> None:
    before = wait_until_idle(server.engine)
    body = {**COMPLETION, "prompt": [[5, 6, 7]] * 3 + [[5, 100000]], "max_tokens": 300, "ignore_eos": True}
    assert openai_error(post(server, "/v1/completions", body), 400)["param"] == "prompt"
    after = wait_until_idle(server.engine)
    assert after["scheduler"]["steps"] - before["scheduler"]["steps"] < 100


def test_prompt_too_long_is_context_length_exceeded_naming_what_the_request_set(server: Server) -> None:
    error = openai_error(post(server, "/v1/completions", {**COMPLETION, "prompt": [5] * 600, "max_tokens": 16}), 400)
    assert re.search(r"prompt \(600 tokens\) \+ max_tokens \(16\) .* context limit of 512 tokens", error["message"])
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "hello " * 600}], "max_tokens": None}
    error = openai_error(post(server, "/v1/chat/completions", long_chat), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "context limit of 512 tokens" in error["message"] and "max_tokens" not in error["message"]
    huge_text = {**COMPLETION, "prompt": "hello " * 5000}  # refused before it is tokenized
    error = openai_error(post(server, "/v1/completions", huge_text), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as refused:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=long_chat["messages"]
        )
    assert refused.value.code == "context_length_exceeded"
    assert_still_serves(server)


def test_unknown_model_is_404(server: Server) -> None:
    error = openai_error(post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).completions.create(
            model="gpt-4", prompt="hi"
        )
    assert_still_serves(server)


def test_malformed_json_never_reaches_the_engine(server: Server) -> None:
    steps = server.engine.stats()["scheduler"]["steps"]
    headers = {"content-type": "application/json"}
    for body in (b'{"model": "tiny-llama", "messages": [', b"[1, 2]", b"null"):
        response = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=headers)
        assert openai_error(response, 400)["type"] == "invalid_request_error"
    anthropic_error = httpx.post(f"{server.url}/v1/messages", content=b"{", headers=headers)
    assert anthropic_error.status_code == 400 and anthropic_error.json()["type"] == "error"
    assert server.engine.stats()["scheduler"]["steps"] == steps
    assert_still_serves(server)


def test_overloaded_engine_is_429_with_retry_after(server: Server) -> None:
    config = server.engine.config  # settings are frozen: the engine reads this copy's bound instead
    server.engine.config = config.replace(max_waiting_requests=0)  # every add now finds the queue full
    try:
        response = post(server, "/v1/chat/completions", CHAT)
        error = openai_error(response, 429)
        assert error["code"] == "rate_limit_exceeded" and int(response.headers["retry-after"]) >= 1
        streamed = openai_error(post(server, "/v1/completions", {**COMPLETION, "stream": True}), 429)
        assert streamed["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="hello", max_tokens=2
            )
        anthropic_error = post(server, "/v1/messages", {**CHAT, "max_tokens": 2})
        assert anthropic_error.status_code == 429 and int(anthropic_error.headers["retry-after"]) >= 1
        assert anthropic_error.json()["error"]["type"] == "rate_limit_error"
    finally:
        server.engine.config = config
    assert_still_serves(server)


def test_internal_error_is_500_with_a_logged_id(
    server: Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("template exploded")

    with monkeypatch.context() as patch:
        patch.setattr(server.engine.tokenizer, "apply_chat_template", broken)
        with caplog.at_level(logging.ERROR, logger="tokenmill.server"):
            error = openai_error(post(server, "/v1/chat/completions", CHAT), 500)
    error_id = re.search(r"err-[0-9a-f]+", error["message"]).group(0)
    record = next(r for r in caplog.records if error_id in r.getMessage())
    assert record.exc_info and "template exploded" in str(record.exc_info[1])
    assert_still_serves(server)


def test_failed_generation_is_500_or_a_stream_error(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(step):
        raise RuntimeError("step exploded")

    with monkeypatch.context() as patch:
        patch.setattr(server.engine.executor, "execute", crash)  # the engine fails the step's requests
        error = openai_error(post(server, "/v1/chat/completions", CHAT), 500)
        assert "step exploded" in error["message"] and "chatcmpl-" in error["message"]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**COMPLETION, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and lines[-1] == "data: [DONE]"
        assert "step exploded" in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]
        with pytest.raises(anthropic.InternalServerError):
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hello"}]
            )
    assert_still_serves(server)


@pytest.fixture(scope="module")
def guarded(checkpoint: Path) -> Server:
    """A second server: API key required, 2 KiB body limit."""
    with serve(
        Engine(dtype="float32", model=str(checkpoint), num_kv_slots=1024), api_key=KEY, max_body_bytes=2048
    ) as live:
        yield live


def test_api_key_is_required_everywhere_but_health(guarded: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        error = openai_error(post(guarded, "/v1/chat/completions", CHAT, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics", "/version"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 401
        assert httpx.get(f"{guarded.url}{path}", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert post(guarded, "/v1/messages", CHAT).json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY).models.list().data[0].id == MODEL
    reply = anthropic.Anthropic(base_url=guarded.url, api_key=KEY).messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hello"}]
    )
    assert reply.usage.output_tokens >= 1
    assert_still_serves(guarded, headers={"x-api-key": KEY})


def test_oversized_body_is_413(guarded: Server) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "hello " * 1000}]}
    headers = {"Authorization": f"Bearer {KEY}"}
    error = openai_error(post(guarded, "/v1/chat/completions", big, headers=headers), 413)
    assert "2048 bytes" in error["message"]

    def chunks():  # no Content-Length: only the bytes received can tell
        yield b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"hello " * 10
        yield b'"}]}'

    chunked = httpx.post(
        f"{guarded.url}/v1/chat/completions", content=chunks(), headers={**headers, "content-type": "application/json"}
    )
    assert "content-length" not in chunked.request.headers
    openai_error(chunked, 413)
    assert_still_serves(guarded, headers=headers)


def test_dead_engine_fails_fast_with_503(checkpoint: Path) -> None:
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=256)) as live:
        assert httpx.get(f"{live.url}/health").status_code == 200
        live.engine.shutdown()
        assert httpx.get(f"{live.url}/health").status_code == 503
        error = openai_error(post(live, "/v1/chat/completions", CHAT), 503)
        assert error["code"] == "engine_dead"
        assert httpx.get(f"{live.url}/metrics").status_code == 200  # without the engine's gauges
        assert openai_error(httpx.get(f"{live.url}/status"), 503)["code"] == "engine_dead"
