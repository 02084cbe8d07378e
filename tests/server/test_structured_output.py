"""Structured output over HTTP: OpenAI ``response_format``, vLLM's ``structured_outputs`` / ``guided_*``,
forced tool calls, and Anthropic tools, through the official clients against live servers.

The constrained tests run on the bundled default model, which cannot write JSON on its own: the
grammar does all the work. Outputs are checked against ``jsonschema``, ``re`` and pydantic, never
against the server's own parser. Anthropic's unconstrained tool use runs on the scripted model
(:mod:`tests.server.scripted_model`), which writes a Hermes call by itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import Server, serve, wait_until_idle
from tests.server.scripted_model import save_scripted_checkpoint
from tokenmill import LLM, Engine, SamplingParams
from tokenmill.request import ParameterError
from tokenmill.server.shared.tool_constraint import forced_call
from tokenmill.server.shared.tool_parser import parse_tool_calls

DEFAULT = "tiny-model"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 200}


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    temperature: int = Field(ge=-40, le=50)
    sunny: bool


class Address(BaseModel):
    city: Literal["Paris", "Oslo"]


class Letter(BaseModel):
    to: Address
    urgent: bool


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": Weather.model_json_schema(),
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]},
    },
}
SCHEMAS = {"get_weather": Weather.model_json_schema(), "get_time": TIME_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def default_server() -> Iterator[Server]:
    with serve(Engine(dtype="float32", num_kv_slots=4096, max_tokens_cap=400)) as live:
        yield live


@pytest.fixture(scope="module")
def client(default_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(default_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=default_server.url, api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=DEFAULT, messages=ASK, **{**GREEDY, **kwargs})


def streamed_chat(client: openai.OpenAI, **kwargs) -> tuple[str, list, str | None]:
    """Content, tool-call deltas and the last finish reason of a streamed chat completion."""
    chunks = list(chat(client, stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, calls, finishes[-1] if finishes else None


# ------------------------------------------------------------------------------------------ OpenAI
def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=DEFAULT, messages=ASK, response_format=Weather, **GREEDY)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed
    nested = client.chat.completions.parse(model=DEFAULT, messages=ASK, response_format=Letter, **GREEDY)
    assert isinstance(nested.choices[0].message.parsed, Letter)  # a schema with $defs


def test_json_object(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model=DEFAULT,
        messages=[{"role": "user", "content": "Write JSON"}],
        response_format={"type": "json_object"},
        **GREEDY,
    ).choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    "extra_body",
    [{"structured_outputs": {"regex": r"[a-z]{3,8}@example\.com"}}, {"guided_regex": r"[a-z]{3,8}@example\.com"}],
)
def test_regex(client: openai.OpenAI, extra_body: dict) -> None:
    choice = chat(client, extra_body=extra_body).choices[0]
    assert re.fullmatch(r"[a-z]{3,8}@example\.com", choice.message.content) and choice.finish_reason == "stop"
    completion = client.completions.create(model=DEFAULT, prompt="def f(", extra_body=extra_body, **GREEDY)
    assert re.fullmatch(r"[a-z]{3,8}@example\.com", completion.choices[0].text)


@pytest.mark.parametrize(
    "extra_body", [{"structured_outputs": {"choice": ["sunny", "rainy"]}}, {"guided_choice": ["sunny", "rainy"]}]
)
def test_choice(client: openai.OpenAI, extra_body: dict) -> None:
    choice = chat(client, extra_body=extra_body, n=2, temperature=1.0, seed=1).choices
    assert [c.message.content in ("sunny", "rainy") and c.finish_reason == "stop" for c in choice] == [True, True]


def test_json_schema_through_structured_outputs_and_guided_json(client: openai.OpenAI) -> None:
    schema = Weather.model_json_schema()
    for extra_body in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        jsonschema.validate(json.loads(chat(client, extra_body=extra_body).choices[0].message.content), schema)


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", {"get_weather", "get_time"}), ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})],
)
def test_forced_tool_call(client: openai.OpenAI, tool_choice, names: set[str]) -> None:
    choice = chat(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, finish = streamed_chat(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice)
    assert content == "" and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name, call.function.arguments)]


def test_streaming_yields_the_same_text(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}
    whole = chat(client, response_format=response_format).choices[0]
    content, _, finish = streamed_chat(client, response_format=response_format)
    assert (content, finish) == (whole.message.content, whole.finish_reason) == (content, "stop")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"tools": [TIME_TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_invalid_constraints_are_a_400_naming_the_parameter(default_server: Server, body: dict, param: str) -> None:
    response = httpx.post(
        f"{default_server.url}/v1/chat/completions", json={"model": DEFAULT, "messages": ASK, **body}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert ".cc:" not in response.json()["error"]["message"]  # xgrammar's log prefix is not for clients
    wait_until_idle(default_server.engine)  # nothing was left allocated


# --------------------------------------------------------------------------------------- Responses
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER_TOOL, TIME_TOOL)]
RESPONSES_GREEDY = {"model": DEFAULT, "input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 200}


def test_responses_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    response = client.responses.parse(**RESPONSES_GREEDY, text_format=Weather)
    assert isinstance(response.output_parsed, Weather) and response.status == "completed"
    assert response.text.format.type == "json_schema"
    events = list(client.responses.create(**RESPONSES_GREEDY, text={"format": _text_format(Weather)}, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == response.output_text and events[-1].type == "response.completed"


def test_responses_json_object(client: openai.OpenAI) -> None:
    fields = {**RESPONSES_GREEDY, "input": "Write JSON"}
    response = client.responses.create(**fields, text={"format": {"type": "json_object"}})
    assert response.status == "completed" and isinstance(json.loads(response.output_text), dict)


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", {"get_weather", "get_time"}), ({"type": "function", "name": "get_time"}, {"get_time"})],
)
def test_responses_forced_tool_call(client: openai.OpenAI, tool_choice, names: set[str]) -> None:
    response = client.responses.create(**RESPONSES_GREEDY, tools=RESPONSES_TOOLS, tool_choice=tool_choice)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name in names
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        (
            {"text": {"format": {"type": "json_object"}}, "tools": RESPONSES_TOOLS, "tool_choice": "required"},
            "tool_choice",
        ),
    ],
)
def test_responses_invalid_constraints_are_a_400_naming_the_parameter(
    default_server: Server, body: dict, param: str
) -> None:
    response = httpx.post(f"{default_server.url}/v1/responses", json={**RESPONSES_GREEDY, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    wait_until_idle(default_server.engine)


def _text_format(model: type[BaseModel]) -> dict:
    return {"type": "json_schema", "name": model.__name__, "schema": model.model_json_schema(), "strict": True}


# --------------------------------------------------------------------------------- forced-call text
@pytest.fixture(scope="module")
def default_llm() -> Iterator[LLM]:
    llm = LLM(dtype="float32", num_kv_slots=2048)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("chat_template", ["", "{{ '<tool_call>' }}"])
def test_forced_call_text_is_what_the_parser_reads(default_llm: LLM, chat_template: str) -> None:
    """Bare JSON for templates without ``<tool_call>``, a Hermes block for those with it; $defs survive."""
    letter = {"type": "function", "function": {"name": "send", "parameters": Letter.model_json_schema()}}
    tools = [letter, TIME_TOOL]
    constraint = forced_call(tools, {"send", "get_time"}, chat_template)
    prompt = "<|user|>\nSend a letter to Paris<|end|>\n<|assistant|>\n"
    (output,) = default_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=300, structured_outputs=constraint)
    )
    text = output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"
    assert text.startswith("<tool_call>\n{") if chat_template else text.startswith("{")
    (call,) = parse_tool_calls(text, {"send", "get_time"}).tool_calls
    schemas = {"send": Letter.model_json_schema(), "get_time": TIME_TOOL["function"]["parameters"]}
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_forced_call_refuses_a_bad_parameters_schema_naming_tools() -> None:
    """The Hermes path builds its grammar from the schema itself: xgrammar's refusal is a clean
    ParameterError on ``tools``, without xgrammar's log prefix."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
    with pytest.raises(ParameterError) as refused:
        forced_call([bad], {"f"}, "{{ '<tool_call>' }}")
    assert refused.value.param == "tools" and ".cc:" not in str(refused.value)


# --------------------------------------------------------------------------------------- Anthropic
CLAUDE_WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": Weather.model_json_schema(),
}
CLAUDE_TIME = {"name": "get_time", "input_schema": TIME_TOOL["function"]["parameters"]}


def test_anthropic_forced_tool_use(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=DEFAULT,
        messages=ASK,
        max_tokens=200,
        tools=[CLAUDE_WEATHER, CLAUDE_TIME],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    Weather.model_validate(block.input)
    jsonschema.validate(block.input, CLAUDE_WEATHER["input_schema"])
    assert message.stop_reason == "tool_use"

    with claude.messages.stream(
        model=DEFAULT,
        messages=ASK,
        max_tokens=200,
        tools=[CLAUDE_WEATHER, CLAUDE_TIME],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == block.input
    (streamed,) = final.content
    assert (streamed.type, streamed.name, streamed.input) == ("tool_use", "get_weather", block.input)
    assert final.stop_reason == "tool_use"


def test_anthropic_any_calls_one_of_the_tools(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=DEFAULT,
        messages=ASK,
        max_tokens=200,
        tools=[CLAUDE_WEATHER, CLAUDE_TIME],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    (block,) = message.content
    schemas = {t["name"]: t["input_schema"] for t in (CLAUDE_WEATHER, CLAUDE_TIME)}
    jsonschema.validate(block.input, schemas[block.name])
    assert message.stop_reason == "tool_use"


def test_anthropic_tool_choice_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=DEFAULT, messages=ASK, max_tokens=5, tools=[CLAUDE_TIME], tool_choice={"type": "tool", "name": "nope"}
        )
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=DEFAULT, messages=ASK, max_tokens=5, tool_choice={"type": "any"})


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("models") / "scripted"
    save_scripted_checkpoint(path)
    with serve(Engine(dtype="float32", model=str(path), num_kv_slots=1024)) as live:
        yield live


def test_anthropic_auto_parses_the_models_own_call(scripted: Server) -> None:
    claude = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)
    weather = {"name": "get_weather", "input_schema": {"type": "object"}}
    kwargs = {"model": "scripted", "messages": [{"role": "user", "content": "weather"}], "max_tokens": 20}
    message = claude.messages.create(tools=[weather], extra_body={"temperature": 0}, **kwargs)
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(tools=[weather], extra_body={"temperature": 0}, **kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    plain = claude.messages.create(
        tools=[weather], tool_choice={"type": "none"}, extra_body={"temperature": 0}, **kwargs
    )
    assert [(b.type, b.text) for b in plain.content] == [("text", " hello world")]
    assert plain.stop_reason == "end_turn"


def test_anthropic_tool_history_renders_as_tool_messages(scripted: Server) -> None:
    claude = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)
    history = [
        {"role": "user", "content": "weather"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "hello"},
            ],
        },
    ]
    expected = scripted.engine.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "weather"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
            {"role": "user", "content": "hello"},
        ]
    )
    decoded = scripted.engine.tokenizer.decode(expected, skip_special_tokens=False)
    assert "call get_weather Paris" in decoded and "tool : sunny" in decoded
    counted = claude.messages.count_tokens(model="scripted", messages=history)
    assert counted.input_tokens == len(expected)
