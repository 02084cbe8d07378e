"""Replies rendered by orjson read back as the standard library renders them: the same JSON value
(non-string keys as strings, non-ASCII text as UTF-8, large integers and float precision intact)."""

from __future__ import annotations

import json

from tokenmill.server.http.json_body import render_json


def test_rendered_replies_read_back_as_the_standard_librarys() -> None:
    content = {
        "text": 'naïve — 東京 🙂 \\u0000 "quoted"',
        "logprobs": [{"a": -1.2345678901234567, "b": -9999.0}, None, True, False],
        "ids": [0, 2**62, -(2**62)],
        7: "an int key",
        "nested": {"list": [[], {}, [1.5e-300, 3.0]]},
    }
    body = render_json(content)
    standard = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    assert json.loads(body) == json.loads(standard)
    assert "東京".encode() in body  # UTF-8, not \u escapes
    assert len(body) == len(standard)  # compact: no spaces between items
