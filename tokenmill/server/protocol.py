"""Request bodies of the OpenAI and Anthropic routes (pydantic).

Only types are checked here; value ranges are the engine's to check (``SamplingParams.validate``),
so both APIs and the Python API reject the same values with the same messages. Unknown fields are
ignored: official clients send fields this server does not use. ``None`` always means "the
default", since some clients send explicit nulls.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------- OpenAI
class StreamOptions(Body):
    include_usage: bool = False


class OpenAISampling(Body):
    """Fields shared by ``/v1/chat/completions`` and ``/v1/completions``, with vLLM's extras."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions (``extra_body`` in the openai client)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None


class ContentPart(Body):
    """A part of a message's content; only ``type == "text"`` is supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCallIn(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: FunctionName


class ResponseFormat(Body):
    type: str


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


# ------------------------------------------------------------------------------------- Anthropic
class AnthropicBlock(Body):
    """A content block: text, or tool_use / tool_result (rendered as text for the chat template)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    name: str | None = None
    input: Any = None
    content: str | list[AnthropicBlock] | None = None


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class MessagesRequest(Body):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
