"""Anthropic content blocks and tools <-> the chat template's messages and tool calls.

In: the system prompt and text blocks become message content; an assistant's ``tool_use`` blocks
become its ``tool_calls`` (input as an object, as in HF's docs); each ``tool_result`` block becomes a
``tool`` message (``tool_call_id`` = its ``tool_use_id``) in its place among the user's blocks.
``tools`` (``name``, ``description``, ``input_schema``) are rendered in the template's function form.
``tool_choice``: ``auto`` (the default) parses calls from the output, ``any`` and ``{"type": "tool"}``
also force one call (:mod:`tokenmill.server.shared.tool_constraint`), ``none`` offers no tools.

Out: calls parsed from the output (:mod:`tokenmill.server.shared.tool_parser`) become ``tool_use`` blocks
(``id`` ``toolu_...``) after the text block, and the stop reason is ``tool_use``. Streamed, each call
is a ``content_block_start`` (tool_use, empty input), one ``input_json_delta`` with the whole input,
and a ``content_block_stop``, sent once the output is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.request import StructuredOutputsParams
from tokenmill.server.anthropic.protocol import AnthropicBlock, AnthropicMessage, MessagesPromptRequest
from tokenmill.server.shared.content_text import joined_text
from tokenmill.server.shared.request_body import FunctionName
from tokenmill.server.shared.tool_constraint import forced_call
from tokenmill.server.shared.tool_parser import ToolCallStream, parse_tool_calls
from tokenmill.server.shared.tools import tool_setup

# Anthropic's tool_choice type -> OpenAI's tool_choice, as ``tool_setup`` takes it
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools mean for its prompt and output.

    ``tools``: rendered into the prompt (None: none); ``names``: the tools whose calls are parsed
    from the output (None: no parsing); ``constraint``: forces one call (None: free output).
    """

    tools: list[dict[str, Any]] | None = None
    names: set[str] | None = None
    constraint: StructuredOutputsParams | None = None


def _block_text(content: str | list[AnthropicBlock] | None) -> str:
    """Anthropic content (a string, or text blocks) as one text; other blocks are a 400 on ``messages``."""
    return joined_text(content, ("text",), "messages")


def tool_use(body: MessagesPromptRequest, chat_template: Any) -> ToolUse:
    """The request's tools and ``tool_choice``; raises APIError (400, ``tool_choice``) for a choice that
    names no offered tool."""
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in body.tools or []
    ]
    choice = body.tool_choice
    openai_choice = FunctionName(name=choice.name or "") if choice and choice.type == "tool" else None
    rendered, names = tool_setup(tools, openai_choice or (_CHOICES[choice.type] if choice else None))
    if rendered is None or names is None or choice is None or choice.type == "auto":
        return ToolUse(rendered, names)
    return ToolUse(rendered, names, forced_call(rendered, names, chat_template))


def template_messages(system: str | list[AnthropicBlock] | None, messages: list[AnthropicMessage]) -> list[dict]:
    """The system prompt and messages as the chat template takes them."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _block_text(system)}] if system else []
    for message in messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant_message(message.content))
        else:
            out.extend(_user_messages(message.content))
    return out


def _assistant_message(blocks: list[AnthropicBlock]) -> dict[str, Any]:
    calls = [block for block in blocks if block.type == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": _block_text([b for b in blocks if b.type != "tool_use"])}
    if calls:
        message["tool_calls"] = [
            {
                "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name or "", "arguments": call.input or {}},
            }
            for call in calls
        ]
    return message


def _user_messages(blocks: list[AnthropicBlock]) -> list[dict[str, Any]]:
    """Tool results as tool messages, and each run of other blocks as one user message, in block order."""
    out: list[dict[str, Any]] = []
    run: list[AnthropicBlock] = []
    for block in [*blocks, None]:
        if block is not None and block.type != "tool_result":
            run.append(block)
            continue
        if run:
            out.append({"role": "user", "content": _block_text(run)})
            run = []
        if block is not None:
            out.append(
                {"role": "tool", "tool_call_id": block.tool_use_id or "", "content": _block_text(block.content or "")}
            )
    return out


def content_blocks(text: str, names: set[str] | None) -> tuple[list[dict[str, Any]], bool]:
    """The reply's content blocks for the output ``text``, and whether it calls tools."""
    if names is None:
        return [{"type": "text", "text": text}], False
    parsed = parse_tool_calls(text, names)
    if not parsed.tool_calls:
        return [{"type": "text", "text": text}], False
    blocks = [{"type": "text", "text": parsed.content}] if parsed.content.strip() else []
    blocks += [_tool_use_block(call.name, call.arguments) for call in parsed.tool_calls]
    return blocks, True


def _tool_use_block(name: str, arguments: str, streamed: bool = False) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": {} if streamed else json.loads(arguments),
    }


class ContentBlockStream:
    """The content-block events of one streamed reply (dicts, each with its ``type``).

    Without tools, the text block opens at :meth:`start`; with tools it opens at the first text that
    cannot be part of a call (or at the end, empty, when there are no calls either). The streamed
    text and calls equal :func:`content_blocks`' (there and here, a reply with calls has no text block
    when its text is whitespace only).
    """

    def __init__(self, names: set[str] | None) -> None:
        self._calls = ToolCallStream(names) if names is not None else None
        self._index = 0
        self._text_open = False

    def start(self) -> list[dict[str, Any]]:
        return self._open_text() if self._calls is None else []

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._text(self._calls.feed(text) if self._calls is not None else text)

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The closing events, and whether the reply calls tools."""
        rest, calls = self._calls.finish() if self._calls is not None else ("", [])
        events = self._text("" if calls and not self._text_open and not rest.strip() else rest)
        if not self._text_open and not calls:
            events += self._open_text()
        if self._text_open:
            events.append({"type": "content_block_stop", "index": self._index})
            self._index += 1
        for call in calls:
            index, self._index = self._index, self._index + 1
            events += [
                {"type": "content_block_start", "index": index, "content_block": _tool_use_block(call.name, "", True)},
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": call.arguments},
                },
                {"type": "content_block_stop", "index": index},
            ]
        return events, bool(calls)

    def _open_text(self) -> list[dict[str, Any]]:
        self._text_open = True
        return [{"type": "content_block_start", "index": self._index, "content_block": {"type": "text", "text": ""}}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = [] if self._text_open else self._open_text()
        events.append(
            {"type": "content_block_delta", "index": self._index, "delta": {"type": "text_delta", "text": text}}
        )
        return events
