"""Streams under load and clients that leave: SSE stays well-formed, and a departed client's
request is aborted with its KV freed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.server.conftest import MODEL, Server, wait_until_idle

LONG = {"model": MODEL, "prompt": "the cat sat on the mat", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_streaming_client_that_leaves_is_aborted_and_its_kv_freed(server: Server) -> None:
    before = wait_until_idle(server.engine)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(10)) if line.startswith("data: ")]
    assert len(received) >= 3  # the connection is closed here, mid-stream
    after = wait_until_idle(server.engine)
    steps = after["scheduler"]["steps"] - before["scheduler"]["steps"]
    assert steps < 200, f"{steps} steps: the request ran on after the client left"


def test_non_streaming_client_that_leaves_is_aborted_and_its_kv_freed(server: Server) -> None:
    before = wait_until_idle(server.engine)
    started = time.monotonic()
    try:
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=0.05)
        raise AssertionError("a 400-token completion should outlast the client's 0.05 s")
    except httpx.ReadTimeout:
        pass
    after = wait_until_idle(server.engine)
    steps = after["scheduler"]["steps"] - before["scheduler"]["steps"]
    # finishing takes 400 steps (0.5-1.5 ms each on 2 cores); the server notices the departure within
    # DISCONNECT_POLL_S (0.1 s) and aborts at the next step
    assert steps < 400, f"{steps} steps in {time.monotonic() - started:.1f}s: the request ran to the end"


async def _stream_chat(client: httpx.AsyncClient, url: str, word: str) -> tuple[str, dict]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"hello {word}"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]  # every other data line is JSON
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def test_64_concurrent_streams_are_well_formed(server: Server) -> None:
    words = ["the", "cat", "dog", "mat", "one", "two", "three", "world"]
    url = f"{server.url}/v1/chat/completions"

    async def run() -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_stream_chat(client, url, words[i % 8]) for i in range(64)))

    results = asyncio.run(run())
    tokenizer = server.engine.tokenizer
    for i, (text, usage) in enumerate(results):
        word = words[i % 8]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"hello {word}"}])
        cached = usage.pop("prompt_tokens_details")["cached_tokens"]  # how many depends on the batching
        assert usage == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}
        assert 0 <= cached < len(prompt)
        assert text == results[i % 8][0]  # same prompt, same greedy text, however batched
    alone = httpx.post(
        url,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello the"}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=30,
    )
    assert alone.json()["choices"][0]["message"]["content"] == results[0][0]
    wait_until_idle(server.engine)
