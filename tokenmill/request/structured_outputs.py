"""StructuredOutputsParams, a constraint on a request's output (a JSON schema, a regex, a choice, a
grammar or any JSON object), and the JSON-schema walk it is validated with: the nesting cap
(:func:`json_nesting`) and the parts the grammar engine would not enforce (:func:`unenforced_schema_part`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.request.checks import is_int, require
from tokenmill.request.errors import ParameterError

MAX_SCHEMA_NESTING = 64
"""The deepest a JSON schema may nest (dicts and lists), given as a dict or as text."""


def json_nesting(value: Any) -> int:
    """The nesting depth of a parsed JSON value (dicts and lists), measured level by level (no recursion)."""
    depth, level = 0, [value]
    while containers := [item for item in level if isinstance(item, (dict, list))]:
        depth += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return depth


UNENFORCED_SCHEMA_KEYWORDS = ("not", "contains", "minContains", "maxContains")
"""JSON Schema keywords the grammar engine accepts but does not enforce: refused (as OpenAI's strict mode)."""
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "if", "then", "else", "propertyNames", "unevaluatedProperties")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def unenforced_schema_part(schema: Any) -> str | None:
    """Why ``schema`` (a parsed JSON schema) cannot be enforced as written, or None. Refused: the
    keywords of :data:`UNENFORCED_SCHEMA_KEYWORDS`; ``oneOf`` without a ``discriminator`` (enforced
    only as ``anyOf``: overlapping branches would match more than one); a ``$ref`` outside the
    document; a length or count bound that is not a non-negative integer. Walks every subschema,
    iteratively (depth is capped elsewhere)."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_SCHEMA_KEYWORDS:
            if keyword in node:
                return f"{keyword} is not enforced"
        if "oneOf" in node and "discriminator" not in node:
            return "oneOf is enforced only with a discriminator (else as anyOf); use anyOf"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"$ref {ref[:100]!r} points outside the schema (only '#...' references are resolved)"
        for name in _COUNTS:
            if name in node and not (is_int(node[name]) and node[name] >= 0):
                return f"{name} must be a non-negative integer, got {node[name]!r}"
        for name in _SCHEMA_MAPS:
            if isinstance(node.get(name), dict):
                pending.extend(node[name].values())
        for name in _SCHEMA_LISTS:
            if isinstance(node.get(name), list):
                pending.extend(node[name])
        for name in _SCHEMA_VALUES:
            pending.append(node.get(name))
        if isinstance(node.get("items"), list):
            pending.extend(node["items"])
    return None


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names); exactly one field must be set.

    ``json``: a JSON schema (a dict or its JSON text); objects allow no properties beyond the
    schema's unless it says ``additionalProperties`` (as OpenAI's ``strict`` mode). ``regex``: the
    whole output matches it. ``choice``: the output is one of these strings. ``grammar``: an EBNF
    grammar in the GBNF dialect of xgrammar and llama.cpp (``root ::= ...``) or a Lark grammar
    (``start: ...``); text containing ``::=`` is read as EBNF, any other as Lark. ``json_object``:
    any JSON object. The output ends ("stop") as soon as the constraint allows nothing more.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    @property
    def kind(self) -> str:
        """The name of the field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        set_fields = self._set_fields()
        if len(set_fields) != 1:
            raise ParameterError("structured_outputs", f"must set exactly one field, got {set_fields or 'none'}")
        return set_fields[0]

    def _set_fields(self) -> list[str]:
        names = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return names + (["json_object"] if self.json_object is not False else [])

    def validate(self, max_chars: int | None) -> None:
        """Raise ParameterError("structured_outputs") unless exactly one field is set, with the right
        type, the spec holds at most ``max_chars`` characters (None: no cap), and a JSON schema (dict
        or text) parses, nests at most :data:`MAX_SCHEMA_NESTING` levels and has no part
        :func:`unenforced_schema_part` refuses. Whether the schema,
        regex or grammar compiles is checked when it is compiled, at intake."""
        param = "structured_outputs"
        require(isinstance(self.json_object, bool), param, f"json_object must be a boolean, got {self.json_object!r}")
        set_fields = self._set_fields()
        require(
            len(set_fields) == 1,
            param,
            f"must set exactly one of json, regex, choice, grammar, json_object; got {set_fields or 'none'}",
        )
        require(self.json is None or isinstance(self.json, (str, dict)), param, "json must be a schema (dict or text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            require(value is None or isinstance(value, str), param, f"{name} must be a string")
        if self.choice is not None:
            require(isinstance(self.choice, list) and bool(self.choice), param, "choice must be a non-empty list")
            bad = [c for c in self.choice if not (isinstance(c, str) and c)]
            require(not bad, param, f"choice must hold non-empty strings, got {bad[:1]!r}")
        chars = self.size()
        require(max_chars is None or chars <= max_chars, param, f"may hold at most {max_chars} characters, got {chars}")
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                depth = json_nesting(schema)
            except RecursionError:  # deeper than Python's decoder goes: far over the limit
                depth = MAX_SCHEMA_NESTING + 1
            except ValueError as exc:
                raise ParameterError(param, f"json is invalid: {exc}") from None
            require(
                depth <= MAX_SCHEMA_NESTING,
                param,
                f"the json schema nests deeper than the limit of {MAX_SCHEMA_NESTING} levels",
            )
            why = unenforced_schema_part(schema)
            require(why is None, param, f"the json schema cannot be enforced: {why}")

    def size(self) -> int:
        """Characters in the spec (a dict schema counts as its compact JSON text)."""
        if isinstance(self.json, dict):
            try:
                return len(json.dumps(self.json, separators=(",", ":")))
            except (TypeError, ValueError) as exc:
                raise ParameterError("structured_outputs", f"json is not a JSON document: {exc}") from exc
        if self.choice is not None:
            return sum(len(c) for c in self.choice)
        return len(self.json or self.regex or self.grammar or "")
