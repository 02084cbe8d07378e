"""The nesting-depth limit on JSON the server reads: request bodies, tool-call arguments, model output.

Python's ``json``, pydantic's validation of recursive models, jinja's rendering and the chat
helpers all recurse once per level, and fail (``RecursionError``) or misreport somewhere between a
few hundred and a thousand levels. The server therefore measures depth without recursing (parsed
values with ``request.json_nesting``, text with :func:`text_depth`) and refuses anything deeper
than :data:`MAX_NESTING_DEPTH` before any of them sees it.

Depth counts containers: a scalar is depth 0, ``[]`` and ``{}`` depth 1, ``{"a": [1]}`` depth 2.
"""

from __future__ import annotations

import re
from itertools import accumulate

MAX_NESTING_DEPTH = 64


def text_depth(text: str) -> int:
    """The most brackets open at any point of JSON ``text`` (openers minus closers so far), strings skipped.

    A JSON decoder recurses once per open bracket and stops at the first error, before which the
    count is exact, so decoding ``text`` never nests deeper than this (for valid JSON: its depth).
    """
    brackets = _BRACKET.findall(_STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets), initial=0))


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)  # a JSON string, possibly unterminated
_BRACKET = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def too_deep_message(what: str) -> str:
    return f"{what} nests deeper than the limit of {MAX_NESTING_DEPTH} levels"
