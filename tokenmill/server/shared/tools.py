"""Tools offered to the chat template: which ones it renders, whose calls are parsed, and tool-call
arguments in the form templates expect."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.server.http.errors import APIError
from tokenmill.server.shared.request_body import FunctionName


def tool_setup(
    tools: list[dict[str, Any]], choice: str | FunctionName | None
) -> tuple[list[dict[str, Any]] | None, set[str] | None]:
    """Tools to render in the prompt, and the names of the tools whose calls are parsed (None: no parsing).

    ``tools`` are in the chat template's form (``{"type": "function", "function": {"name", ...}}``);
    ``choice`` is ``tool_choice``: "none", "auto" (also None), "required", or a named function.
    """
    choice = choice or "auto"
    if not tools:
        if choice not in ("auto", "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    if choice == "none":
        return None, None
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, str):
        return tools, names
    if choice.name not in names:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools", param="tool_choice")
    return tools, {choice.name}


def json_object_or_text(arguments: str) -> Any:
    """Tool-call arguments as chat templates expect them: a JSON object as a dict, anything else as its text."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:  # not JSON: keep the text (its depth is bounded: ``FunctionCall``)
        return arguments
    return value if isinstance(value, dict) else arguments
