"""The Anthropic route through the official ``anthropic`` client, checked against the engine's own output."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import pytest

from tests.server.conftest import MODEL, Server, engine_generate
from tokenmill import SamplingParams

SYSTEM = "the cat"
MESSAGES = [{"role": "user", "content": "hello world"}]
# this client version has no sampling keywords; the Messages API (and this server) still takes them
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy(server: Server) -> tuple[list[int], str]:
    """The chat prompt and its first 10 greedy tokens' text (the engine's own output)."""
    prompt = server.engine.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, *MESSAGES])
    out = engine_generate(server.engine, prompt, SamplingParams(max_tokens=10, temperature=0)).outputs[0]
    assert out.finish_reason == "length", "the tiny model ended early; pick another prompt"
    return prompt, out.text


def test_message_matches_the_engine(client: anthropic.Anthropic, greedy: tuple[list[int], str]) -> None:
    prompt, text = greedy
    message = client.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=10, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage  # the greedy fixture ran this prompt: most of it comes from the prefix cache
    assert (usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens) == (len(prompt), 10)
    blocks = client.messages.create(
        model=MODEL,
        system=[{"type": "text", "text": SYSTEM}],
        max_tokens=10,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello world"}]}],
        extra_body={"temperature": 0, "top_p": 0.9, "top_k": 5},
    )
    assert blocks.content[0].text == text


def test_stream_events_text_and_final_message(client: anthropic.Anthropic, greedy: tuple[list[int], str]) -> None:
    prompt, text = greedy
    with client.messages.stream(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=10, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    usage = final.usage
    assert (usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens) == (len(prompt), 10)


def test_count_tokens_counts_the_prompt_a_message_call_reads(
    client: anthropic.Anthropic, greedy: tuple[list[int], str]
) -> None:
    """``count_tokens`` is the whole prompt through the chat template; a messages call splits the same
    number into ``input_tokens`` and the cache's share (Anthropic's usage arithmetic)."""
    prompt, _ = greedy
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == len(prompt)
    blocks = [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    assert client.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": SYSTEM}], messages=blocks) == (
        counted
    )
    usage = client.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=2, **GREEDY).usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == len(prompt)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="other", messages=MESSAGES)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as empty:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert empty.value.body["error"]["type"] == "invalid_request_error"


def test_usage_reports_prefix_cache_reads(client: anthropic.Anthropic, server: Server) -> None:
    """The second identical prompt is read from the prefix cache (page size 1, ample KV slots): all of
    it but the last token, which is computed for its logits; nothing is ever billed as a cache write."""
    system = " ".join(f"w{i}" for i in range(20, 60))  # words no other test sends: the first call misses
    prompt = server.engine.tokenizer.apply_chat_template([{"role": "system", "content": system}, *MESSAGES])
    first = client.messages.create(model=MODEL, system=system, messages=MESSAGES, max_tokens=2, **GREEDY).usage
    assert first.cache_read_input_tokens < 10 and first.cache_creation_input_tokens == 0
    assert first.input_tokens + first.cache_read_input_tokens == len(prompt)
    second = client.messages.create(model=MODEL, system=system, messages=MESSAGES, max_tokens=2, **GREEDY).usage
    expected = {"input_tokens": 1, "cache_read_input_tokens": len(prompt) - 1, "cache_creation_input_tokens": 0}
    assert second.model_dump(include=set(expected)) == expected
    with client.messages.stream(model=MODEL, system=system, messages=MESSAGES, max_tokens=2, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (start,) = [e for e in events if e.type == "message_start"]
    (end,) = [e for e in events if e.type == "message_delta"]
    assert start.message.usage.model_dump(include=set(expected)) == expected
    assert end.usage.model_dump(include=set(expected)) == expected and end.usage.output_tokens == 2
    assert final.usage.model_dump(include=set(expected)) == expected


def test_raw_stream_has_the_full_event_sequence(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": MESSAGES}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=30) as response:
        names = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) <= {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequence(client: anthropic.Anthropic, greedy: tuple[list[int], str]) -> None:
    _, text = greedy
    stop = text.split()[2]
    message = client.messages.create(
        model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=10, stop_sequences=[stop, "never appears"], **GREEDY
    )
    assert message.content[0].text == text[: text.index(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


def test_tool_blocks_become_tool_messages_and_errors_use_anthropics_shape(
    client: anthropic.Anthropic, server: Server
) -> None:
    history = [
        {"role": "user", "content": "hello"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "the cat sat"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "the dog sat on the mat"}],
        },
    ]
    # the template gets the call as the assistant's tool_calls and the result as a tool message (words in the tiny
    # tokenizer's vocabulary, so that the prompt's tokens, not only their count, depend on them)
    call = {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "the cat sat"}}}
    rendered = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "content": "the dog sat on the mat"},
    ]
    engine = server.engine
    prompt = engine.tokenizer.apply_chat_template(rendered)
    expected = engine_generate(engine, prompt, SamplingParams(max_tokens=8, temperature=0)).outputs[0]
    reply = client.messages.create(model=MODEL, messages=history, max_tokens=8, **GREEDY)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    assert reply.usage.output_tokens == len(expected.token_ids)
    assert reply.content[0].text == expected.text
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="other", messages=MESSAGES, max_tokens=2)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    assert "'other'" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"temperature": -1})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]


def test_aborted_requests_end_in_an_error_never_end_turn(client: anthropic.Anthropic, server: Server) -> None:
    """Requests the server aborts (here: an admin abort while generation is paused, so both are
    surely unfinished) end in a 503 ``overloaded_error`` or, mid-stream, an ``error`` event; no
    stop reason (``end_turn``) is ever reported for them."""
    engine = server.engine
    outcome: dict[str, object] = {}

    def plain() -> None:
        try:
            client.messages.create(model=MODEL, max_tokens=50, messages=MESSAGES)
            outcome["plain"] = "completed"
        except anthropic.APIStatusError as exc:
            outcome["plain"] = (exc.status_code, exc.body["error"]["type"])

    def streamed() -> None:
        body = {"model": MODEL, "max_tokens": 50, "stream": True, "messages": MESSAGES}
        with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=30) as response:
            outcome["stream"] = [line for line in response.iter_lines() if line.startswith(("event: ", "data: "))]

    engine.pause_generation()
    try:
        workers = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 30
        while engine.stats()["active_requests"] < 2:
            assert time.monotonic() < deadline, "the two requests never arrived"
            time.sleep(0.01)
        assert engine.abort_all() == 2
    finally:
        engine.resume_generation()
    for worker in workers:
        worker.join(30)
    assert outcome["plain"] == (503, "overloaded_error")
    lines = outcome["stream"]
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[-1] == "error" and "message_delta" not in events
    assert '"type": "overloaded_error"' in lines[-1] or '"type":"overloaded_error"' in lines[-1]
