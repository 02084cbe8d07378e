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


def test_a_reply_rendered_member_by_member_is_the_reply_rendered_whole() -> None:
    """The top levels are joined around one orjson call per member: byte for byte what one call gives."""
    choice = {"index": 0, "text": "é", "logprobs": {"top_logprobs": [{"a": -0.5, 3: -1.0}], "tokens": ["a"]}}
    reply = {"id": "cmpl-1", "choices": [choice, dict(choice, index=1)], "usage": {"prompt_tokens": 2}, "empty": []}
    whole = render_json(reply, split_levels=0)
    for levels in (1, 2, 3):
        assert render_json(reply, split_levels=levels) == whole
    assert render_json([], split_levels=2) == b"[]" and render_json({}, split_levels=2) == b"{}"
    assert render_json({1: "int key"}, split_levels=2) == b'{"1":"int key"}'
