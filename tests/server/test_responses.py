"""``POST /v1/responses`` through the official ``openai`` client, against the engine and the chat template.

The model is :mod:`tests.server.scripted_model`: a real llama checkpoint whose greedy output is fixed
by the last tool name the chat template rendered (" hello world" without tools, a Hermes call to
``get_weather`` when it is offered last, plain " hello world" when ``lookup`` is last), so every
output is known, and the prompt the server built is checked by its token count against the chat
template applied to the expected messages.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import Server, engine_generate, serve
from tests.server.scripted_model import save_scripted_checkpoint
from tokenmill import Engine, SamplingParams

MODEL = "scripted"
ASK = "weather in Paris"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
LOOKUP = {"type": "function", "name": "lookup"}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Server:
    path = tmp_path_factory.mktemp("models") / MODEL
    save_scripted_checkpoint(path)
    with serve(Engine(dtype="float32", model=str(path), num_kv_slots=1024)) as live:
        yield live


@pytest.fixture(scope="module")
def client(scripted: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="unused", max_retries=0)


def template(server: Server, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The chat template applied to ``messages`` (and chat-form ``tools``) by the tokenizer itself."""
    return server.engine.tokenizer.apply_chat_template(messages, tools=tools)


def chat_tool(tool: dict) -> dict:
    """A flat Responses function tool in chat's nested form, as chat templates receive it."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_string_input_is_one_user_message(client: openai.OpenAI, scripted: Server) -> None:
    prompt = template(scripted, [{"role": "user", "content": ASK}])
    truth = engine_generate(scripted.engine, prompt, SamplingParams(temperature=0, max_tokens=20))
    reply = client.responses.create(model=MODEL, input=ASK, temperature=0)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    assert reply.status == "completed" and reply.incomplete_details is None
    (message,) = reply.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.status == "completed"
    assert [part.type for part in message.content] == ["output_text"]
    assert reply.output_text == truth.outputs[0].text == " hello world"
    usage = reply.usage
    assert usage.input_tokens == len(prompt) and usage.output_tokens == len(truth.outputs[0].token_ids) == 3
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    again = client.responses.create(model=MODEL, input=ASK, temperature=0)  # the same prompt: a prefix-cache hit
    assert 0 < again.usage.input_tokens_details.cached_tokens < len(prompt)


def test_instructions_and_message_items_reach_the_template(client: openai.OpenAI, scripted: Server) -> None:
    items = [
        {"role": "developer", "content": "weather"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "world"}]},
        {"role": "user", "content": ASK},
    ]
    reply = client.responses.create(model=MODEL, instructions="sunny", input=items, temperature=0)
    expected = [
        {"role": "system", "content": "sunny"},
        {"role": "system", "content": "weather"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": ASK},
    ]
    assert reply.usage.input_tokens == len(template(scripted, expected))
    assert reply.instructions == "sunny" and reply.output_text == " hello world"


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input=ASK, max_output_tokens=1, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == " hello" and reply.usage.output_tokens == 1
    assert reply.output[0].status == "incomplete" and reply.max_output_tokens == 1


def test_stream_sends_the_event_sequence_of_the_whole_reply(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=ASK, temperature=0)
    with client.responses.stream(model=MODEL, input=ASK, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text == final.output_text == whole.output_text
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stream_ends_incomplete_at_max_output_tokens(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=1, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].content[0].text == " hello"


def test_function_call_round_trip(client: openai.OpenAI, scripted: Server) -> None:
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], temperature=0)
    (call,) = first.output  # the reply is only the call: no whitespace-only message
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and first.status == "completed"
    assert first.tools[0].name == "get_weather"

    history = [
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = client.responses.create(model=MODEL, input=history, tools=[LOOKUP], temperature=0)
    assert second.output_text == " hello world" and [item.type for item in second.output] == ["message"]
    expected = template(
        scripted,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        ],
        [chat_tool(LOOKUP)],
    )
    decoded = scripted.engine.tokenizer.decode(expected, skip_special_tokens=False)
    assert "call get_weather Paris" in decoded and "tool : sunny" in decoded
    assert second.usage.input_tokens == len(expected)


def test_streamed_function_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert events[4].arguments == call.arguments and events[4].item_id == call.id


def test_tool_choice_none_does_not_offer_the_tools(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="none", temperature=0)
    assert reply.output_text == " hello world" and [item.type for item in reply.output] == ["message"]


def test_previous_response_id_is_refused(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=ASK, temperature=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="and tomorrow?", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    assert "does not store responses" in err.value.body["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": ASK, "max_output_tokens": "10"}, "max_output_tokens"),
        ({"input": ASK, "temperature": True}, "temperature"),
        ({"input": ASK, "temperature": -1.0}, "temperature"),
        ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": ASK, "tool_choice": {"type": "function", "name": "get_time"}, "tools": [WEATHER]}, "tool_choice"),
    ],
)
def test_bad_fields_get_a_400_naming_them(scripted: Server, fields: dict, param: str) -> None:
    reply = httpx.post(f"{scripted.url}/v1/responses", json={"model": MODEL, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_error_messages_use_this_apis_parameter_names(scripted: Server) -> None:
    """The engine's names (max_tokens, prompt) never reach a Responses client: max_output_tokens, input."""
    url = f"{scripted.url}/v1/responses"
    zero = httpx.post(url, json={"model": MODEL, "input": ASK, "max_output_tokens": 0}).json()["error"]
    assert zero["message"] == "max_output_tokens must be >= 1, got 0", zero
    too_long = httpx.post(url, json={"model": MODEL, "input": ASK, "max_output_tokens": 10**6}).json()["error"]
    assert too_long["param"] == "input" and too_long["message"].startswith("input "), too_long
    assert "max_output_tokens (1000000)" in too_long["message"] and "max_tokens" not in too_long["message"], too_long
