"""Tool calls: the parser on strings, then end to end through the real engine and server.

End to end, the model is :mod:`tests.server.scripted_model`: a real llama checkpoint whose weights
make greedy decoding emit a fixed token sequence chosen by the last tool name the chat template
rendered. Nothing is stubbed: the tools reach the prompt only through the chat template, the
engine generates the call token by token, and the server's parser turns the text into
``tool_calls``.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import Server, serve
from tests.server.scripted_model import save_scripted_checkpoint
from tokenmill import Engine
from tokenmill.server.shared.tool_parser import ToolCallStream, parse_tool_calls

NAMES = {"get_weather", "get_time"}


# ------------------------------------------------------------------------------------------ parser
def test_hermes_calls_with_content_around() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    )
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "UTC"}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_time", "parameters": {"tz": "UTC"}}',
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
        '  {"name": "get_time", "arguments": {"tz": "UTC"}}\n',
    ],
)
def test_llama_json_call(text: str) -> None:
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_time", {"tz": "UTC"})]


def test_llama_json_several_calls() -> None:
    one = '{"name": "get_time", "parameters": {}}'
    two = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for text in (f"{one}; {two}", f"[{one}, {two}]"):
        assert [c.name for c in parse_tool_calls(text, NAMES).tool_calls] == ["get_time", "get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>nope</tool_call>',  # one bad of two
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not an offered tool
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # arguments not an object
        '{"name": "get_time", "parameters": {"tz": "UTC"}} and some words',  # JSON is not the whole output
        '{"name": "get_time"',
        'The answer is {"a": 1}',
        "plain text",
    ],
)
def test_malformed_or_foreign_calls_are_plain_content(text: str) -> None:
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize(
    "text",
    [
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        '{"name": "get_time", "parameters": {"tz": "UTC"}}',
        "no call here, just <tool_ words",
        '{"not": "a call"} at all',
    ],
)
def test_stream_never_leaks_call_text_and_ends_with_the_parse(text: str) -> None:
    stream = ToolCallStream(NAMES)
    streamed = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    parsed = parse_tool_calls(text, NAMES)
    assert streamed + rest == parsed.content
    assert [c.name for c in calls] == [c.name for c in parsed.tool_calls]
    assert "<tool_call>" not in streamed and "{" not in streamed[:1]


# -------------------------------------------------------------------------------------- end to end
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "weather of a city", "parameters": CITY},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "weather in Paris"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Server:
    path = tmp_path_factory.mktemp("models") / "scripted"
    save_scripted_checkpoint(path)
    with serve(Engine(dtype="float32", model=str(path), num_kv_slots=1024)) as live:
        yield live


@pytest.fixture(scope="module")
def client(scripted: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, tools: list[dict] | None, **kwargs):
    return client.chat.completions.create(
        model="scripted", messages=ASK, temperature=0, max_tokens=20, **({"tools": tools} if tools else {}), **kwargs
    )


def test_hermes_tool_call_end_to_end(client: openai.OpenAI) -> None:
    reply = chat(client, [TIME, WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.usage.completion_tokens == 8  # seven pieces and EOS


def test_llama_json_tool_call_end_to_end(client: openai.OpenAI) -> None:
    choice = chat(client, [TIME], tool_choice="auto").choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_time", {"tz": "UTC"})
    ]


def test_tool_call_streams_as_one_delta(client: openai.OpenAI) -> None:
    chunks = list(chat(client, [WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == ""
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_does_not_render_tools(client: openai.OpenAI) -> None:
    choice = chat(client, [WEATHER], tool_choice="none").choices[0]
    assert choice.message.content == " hello world" and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_tool_history_reaches_the_template(client: openai.OpenAI, scripted: Server) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        model="scripted", messages=history, tools=[WEATHER], max_tokens=20, temperature=0
    )
    expected = scripted.engine.tokenizer.apply_chat_template(
        [
            ASK[0],
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    decoded = scripted.engine.tokenizer.decode(expected, skip_special_tokens=False)
    assert "call get_weather Paris" in decoded and "tool : sunny" in decoded
    assert reply.usage.prompt_tokens == len(expected)


def test_tool_choice_needs_offered_tools(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, [TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        chat(client, None, tool_choice="required")
