"""Forced tool calls: an output constraint whose every match is one call to an offered tool.

The constrained text is a call as :func:`~tokenmill.server.shared.tool_parser.parse_tool_calls` reads it,
in the form the chat template teaches the model: a Hermes ``<tool_call>`` block when the template
writes one (an EBNF grammar: xgrammar's grammar of the call's JSON schema between the tags), else a
bare JSON call ``{"name": ..., "arguments": {...}}`` (a JSON schema). Either way the JSON is
compact and its objects allow no properties beyond their schema's, as for any JSON schema the
engine constrains to. The call object holds exactly ``name`` (one of the tools)
and ``arguments`` (matching that tool's parameters schema; any object when it has none).

A parameters schema keeps its ``$defs`` / ``definitions``: they move to the root of the call
schema under names prefixed per tool, and its ``$ref`` pointers are rewritten to match.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import xgrammar as xgr

from tokenmill.engine.grammar import xgrammar_message
from tokenmill.request import ParameterError, StructuredOutputsParams, unenforced_schema_part
from tokenmill.server.shared.params import OutputConstraint
from tokenmill.server.shared.tool_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_DEFS_KEYS = ("$defs", "definitions")


def output_constraint(
    given: OutputConstraint | None,
    tools: list[dict[str, Any]] | None,
    tool_names: Collection[str] | None,
    tool_choice: object,
    chat_template: Any,
) -> OutputConstraint | None:
    """A request's output constraint: a forced call (:func:`forced_call`, named ``tools`` in errors)
    when ``tool_choice`` is "required" or a named function and the tools are offered, else ``given``
    (the request's structured-output parameter, or None). Raises ParameterError("tool_choice") when
    a forced call meets ``given``: a request takes one constraint."""
    if tools is None or tool_names is None or tool_choice in (None, "auto"):
        return given
    if given is not None:
        raise ParameterError("tool_choice", f"that forces a tool call cannot be combined with {given.param}")
    return OutputConstraint("tools", forced_call(tools, tool_names, chat_template))


def forced_call(tools: list[dict[str, Any]], names: Collection[str], chat_template: Any) -> StructuredOutputsParams:
    """A constraint matching exactly one call to one of ``tools`` whose name is in ``names``.

    ``tools`` are in the chat template's form (``{"type": "function", "function": {"name", "parameters"}}``);
    ``chat_template`` is the template's text, or a dict of named templates.
    """
    defs: dict[str, Any] = {}
    functions = [t["function"] for t in tools if t["function"]["name"] in names]
    calls = [_call_schema(i, f["name"], f.get("parameters"), defs) for i, f in enumerate(functions)]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema = {**schema, "$defs": defs}
    why = unenforced_schema_part(schema)
    if why is not None:
        raise ParameterError("tools", f"hold a parameters schema that cannot be enforced: {why}")
    if TOOL_CALL_OPEN not in str(chat_template or ""):
        return StructuredOutputsParams(json=schema)
    try:
        call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except RuntimeError as exc:  # xgrammar's refusal of a schema
        message = xgrammar_message(exc)
        raise ParameterError("tools", f"hold a parameters schema that cannot be enforced: {message}") from exc
    tags = [
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")
        for text in (TOOL_CALL_OPEN + "\n", "\n" + TOOL_CALL_CLOSE)
    ]
    return StructuredOutputsParams(grammar=str(xgr.Grammar.concat(tags[0], call, tags[1])))


def _call_schema(index: int, name: str, parameters: dict[str, Any] | None, defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of a call to tool ``name``; its parameters' definitions go into ``defs``."""
    arguments: dict[str, Any] = {"type": "object"}
    if parameters:
        prefix = f"tool{index}_"
        arguments = _rewrite_refs({k: v for k, v in parameters.items() if k not in _DEFS_KEYS}, prefix)
        arguments.setdefault("type", "object")
        for key in _DEFS_KEYS:
            definitions = parameters.get(key)
            for def_name, definition in definitions.items() if isinstance(definitions, dict) else ():
                defs[prefix + def_name] = _rewrite_refs(definition, prefix)
        if _refers_to_root(parameters):
            defs[prefix.rstrip("_")] = arguments
            arguments = {"$ref": f"#/$defs/{prefix.rstrip('_')}"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rewrite_refs(value: Any, prefix: str) -> Any:
    """``value`` with each local ``$ref`` pointing at the hoisted definitions (``#`` -> the tool's root)."""
    if isinstance(value, list):
        return [_rewrite_refs(item, prefix) for item in value]
    if not isinstance(value, dict):
        return value
    out = {k: _rewrite_refs(v, prefix) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str):
        if ref == "#":
            out["$ref"] = f"#/$defs/{prefix.rstrip('_')}"
        for key in _DEFS_KEYS:
            if ref.startswith(f"#/{key}/"):
                out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3 :]}"
    return out


def _refers_to_root(value: Any) -> bool:
    if isinstance(value, list):
        return any(_refers_to_root(item) for item in value)
    if isinstance(value, dict):
        return value.get("$ref") == "#" or any(_refers_to_root(v) for v in value.values())
    return False
