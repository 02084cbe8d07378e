"""Request bodies of the Anthropic routes (pydantic), with the conventions of
:mod:`~tokenmill.server.shared.request_body`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.server.shared.request_body import Body, RequestBody


class AnthropicBlock(Body):
    """A content block: text, tool_use (``id``, ``name``, ``input``) or tool_result (``tool_use_id``, ``content``)."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None
    id: StrictStr | None = None
    name: StrictStr | None = None
    input: dict[str, Any] | None = None
    tool_use_id: StrictStr | None = None
    content: StrictStr | list[AnthropicBlock] | None = None


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: StrictStr | list[AnthropicBlock]


class AnthropicTool(Body):
    """A client tool; ``input_schema`` is the JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _name_given(self) -> AnthropicToolChoice:
        if self.type == "tool" and self.name is None:
            raise PydanticCustomError("missing", "type 'tool' needs the tool's name")
        return self


class MessagesPromptRequest(RequestBody):
    """What makes a Messages prompt; the whole body of ``/v1/messages/count_tokens``."""

    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(MessagesPromptRequest):
    max_tokens: StrictInt
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = False
