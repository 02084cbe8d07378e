"""Request bodies of the OpenAI and Anthropic routes (pydantic).

Only types and nesting are checked here; value ranges are the engine's to check
(``SamplingParams.validate``), so both APIs and the Python API reject the same values with the same
messages. Types are strict, as in OpenAI's API: no bool for a number, no string for a number or a
bool, no float for an int (JSON ints are accepted for floats). Unknown fields are ignored: official
clients send fields this server does not use. ``None`` always means "the default", since some
clients send explicit nulls. A body, and tool-call arguments given as JSON text, nest at most
:data:`~tokenmill.server.nesting.MAX_NESTING_DEPTH` levels; that is checked before anything else
looks at them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenmill.server.nesting import MAX_NESTING_DEPTH, text_depth, too_deep_message, value_depth

MAX_DEPTH_ERROR = "nesting_too_deep"


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(Body):
    """A whole request body: its nesting depth is checked on the parsed JSON, before any field."""

    @model_validator(mode="before")
    @classmethod
    def _shallow_enough(cls, data: Any) -> Any:
        if value_depth(data) > MAX_NESTING_DEPTH:
            raise PydanticCustomError(MAX_DEPTH_ERROR, too_deep_message("the JSON"))
        return data


# ---------------------------------------------------------------------------------------- OpenAI
class StreamOptions(Body):
    include_usage: StrictBool = False


class OpenAISampling(RequestBody):
    """Fields shared by ``/v1/chat/completions`` and ``/v1/completions``, with vLLM's extras."""

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    n: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM extensions (``extra_body`` in the openai client)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    prompt_logprobs: StrictInt | None = None


class ContentPart(Body):
    """A part of a message's content; only ``type == "text"`` is supported."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(Body):
    name: StrictStr
    arguments: StrictStr

    @field_validator("arguments")
    @classmethod
    def _shallow_enough(cls, arguments: str) -> str:
        if text_depth(arguments) > MAX_NESTING_DEPTH:
            raise PydanticCustomError(MAX_DEPTH_ERROR, too_deep_message("the JSON text"))
        return arguments


class ToolCallIn(Body):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None


class FunctionDef(Body):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(Body):
    name: StrictStr


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: FunctionName


class ResponseFormat(Body):
    type: StrictStr


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(OpenAISampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None


# ------------------------------------------------------------------------------------- Anthropic
class AnthropicBlock(Body):
    """A content block: text, or tool_use / tool_result (rendered as text for the chat template)."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None
    name: StrictStr | None = None
    input: Any = None
    content: StrictStr | list[AnthropicBlock] | None = None


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: StrictStr | list[AnthropicBlock]


class MessagesRequest(RequestBody):
    model: StrictStr
    max_tokens: StrictInt
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[AnthropicBlock] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = False
    tools: list[dict[str, Any]] | None = None
