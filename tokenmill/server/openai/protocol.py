"""Request bodies of the OpenAI routes (chat completions, completions, responses, embeddings; pydantic), with
vLLM's extras. The conventions (strict types, ignored unknown fields, ``None`` as the default, the
depth cap) are :mod:`~tokenmill.server.shared.request_body`'s; tool-call arguments given as JSON
text nest at most :data:`~tokenmill.server.http.nesting.MAX_NESTING_DEPTH` levels too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenmill.server.http.nesting import MAX_NESTING_DEPTH, text_depth, too_deep_message
from tokenmill.server.shared.request_body import MAX_DEPTH_ERROR, Body, FunctionName, RequestBody


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


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


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: FunctionName


class JSONSchemaFormat(Body):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", "type 'json_schema' needs a json_schema object")
        return self


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: exactly one constraint (the engine checks that)."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class CompletionRequest(OpenAISampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None


class EmbeddingRequest(RequestBody):
    model: StrictStr
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = None  # vLLM's: embed each input's last k tokens


class RerankDocument(Body):
    """A document given as an object (Cohere's shape): its text."""

    text: StrictStr


class RerankRequest(RequestBody):
    """vLLM's (Jina's / Cohere's) rerank body."""

    model: StrictStr
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: StrictInt | None = None
    return_documents: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = None


class ScoreRequest(RequestBody):
    """vLLM's score body: ``text_1`` the query (one text), ``text_2`` the documents."""

    model: StrictStr
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: StrictInt | None = None


# ------------------------------------------------------------------------------ OpenAI Responses
class InputPart(Body):
    """A part of an input item's content; only ``input_text`` and ``output_text`` are supported."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputPart]


class FunctionCallItem(FunctionCall):
    """A function call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: StrictStr


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputPart]


def _input_item_type(item: Any) -> Any:
    """An input item's ``type``; items without one are messages, as in OpenAI's API."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _input_item_type,
        custom_error_type="unsupported_item",
        custom_error_message="input items must be of type message, function_call or function_call_output",
    ),
]
# a string (one user message) or items; tagged so that errors name the branch that applies
ResponsesInput = Annotated[
    Annotated[StrictStr, Tag("text")] | Annotated[list[InputItem], Field(min_length=1), Tag("items")],
    Discriminator(lambda value: "text" if isinstance(value, str) else "items"),
]


class FunctionTool(FunctionDef):
    """A function tool of the Responses API: flat, unlike chat's ``{"type", "function": {...}}``."""

    type: Literal["function"]
    strict: StrictBool | None = None


class ResponsesToolChoice(FunctionName):
    type: Literal["function"]


class TextFormat(Body):
    """``text.format``: flat, unlike chat's ``response_format`` (``{"type": "json_schema", "name", "schema"}``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise PydanticCustomError("missing", "type 'json_schema' needs a name and a schema")
        return self


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: StrictStr
    input: ResponsesInput
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    text: TextConfig | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None  # accepted and ignored: responses are never stored
