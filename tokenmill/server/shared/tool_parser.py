"""Tool calls in generated text, in the two common open-model styles.

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, anywhere in
  the text, any number of them; the text outside the blocks is the message content.
- Llama 3 JSON: the whole output (optionally after ``<|python_tag|>``) is a call
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` also accepted), several of them separated
  by ``;``, or a JSON list of them; there is no content then.

A call counts only if it is well-formed JSON, nested at most
:data:`~tokenmill.server.http.nesting.MAX_NESTING_DEPTH` levels, with a string ``name`` among the
offered tool names and an object of arguments. If any candidate call is malformed, the whole text
is plain content: a half-understood tool call is never returned.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from tokenmill.server.http.nesting import MAX_NESTING_DEPTH, text_depth

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ParsedOutput:
    content: str  # the text outside tool calls, whitespace kept ("" for Llama-3 JSON calls)
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, names: Collection[str]) -> ParsedOutput:
    """Split ``text`` into content and calls to the tools in ``names``; no calls -> all content."""
    hermes = _parse_hermes(text, names)
    if hermes is not None:
        return hermes
    calls = _parse_llama_json(text, names)
    return ParsedOutput("", calls) if calls else ParsedOutput(text, [])


def _call(obj: Any, names: Collection[str], *argument_keys: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = obj[key] if key else {}
    if isinstance(arguments, str):  # some models emit the arguments already serialized
        arguments = _decode(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _decode(text: str) -> Any:
    """``text`` as JSON; None if it is not JSON or nests too deeply to decode safely."""
    if text_depth(text) > MAX_NESTING_DEPTH:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _parse_hermes(text: str, names: Collection[str]) -> ParsedOutput | None:
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks:
        return None
    calls = []
    for block in blocks:
        call = _call(_decode(block.group(1)), names, "arguments", "parameters")
        if call is None:
            return None
        calls.append(call)
    return ParsedOutput(_HERMES_BLOCK.sub("", text), calls)


def _parse_llama_json(text: str, names: Collection[str]) -> list[ToolCall]:
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).strip()
    if text_depth(body) > MAX_NESTING_DEPTH:
        return []
    decoder, pos, objects = json.JSONDecoder(), 0, []
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        objects.extend(value if isinstance(value, list) else [value])
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    calls = [_call(obj, names, "parameters", "arguments") for obj in objects]
    return calls if calls and all(calls) else []  # type: ignore[return-value]


class ToolCallStream:
    """Streams content while withholding text that may still turn out to be a tool call.

    Held back: everything while the output (ignoring leading whitespace) may be Llama-3 JSON (it
    starts with ``{``, ``[`` or ``<|python_tag|>``); otherwise everything from the first
    ``<tool_call>`` on, a trailing partial ``<tool_call>`` tag, and trailing whitespace (so that
    the space before a call is not streamed as content). ``finish`` parses the whole text
    and returns the content not yet streamed and the calls. Streamed content plus that rest equals
    :func:`parse_tool_calls`' content.
    """

    def __init__(self, names: Collection[str]) -> None:
        self._names = names
        self._text = ""
        self._sent = 0

    def feed(self, delta: str) -> str:
        """Add generated text; return the content that is safe to stream now."""
        self._text += delta
        end = max(self._sent, len(self._text[: self._safe_end()].rstrip()))
        out, self._sent = self._text[self._sent : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        parsed = parse_tool_calls(self._text, self._names)
        return parsed.content[self._sent :], parsed.tool_calls

    def _safe_end(self) -> int:
        text = self._text
        head = text.lstrip()
        if not head or head[0] in "{[" or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            return 0
        start = text.find(TOOL_CALL_OPEN)
        if start >= 0:
            return start
        for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(TOOL_CALL_OPEN[:size]):
                return len(text) - size
        return len(text)
