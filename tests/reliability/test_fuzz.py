"""Malformed and hostile request bodies on /v1/chat/completions, /v1/completions and /v1/messages.

Bodies are valid requests with fields replaced by wrong types, extreme numbers (1e308, 2**63,
NaN and Infinity as JSON extensions), lone surrogates, deep nesting, out-of-vocabulary or
non-numeric ``logit_bias`` keys, odd roles and message shapes, or raw bytes that are not JSON or
not UTF-8. The server must answer every one without a 5xx (and without an error inside a 200
stream), and afterwards still serve a normal request from a healthy, idle engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL, Server, serve, wait_until_idle
from tests.tiny_models import save_tiny_checkpoint
from tokenmill import Engine

ENDPOINTS = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
}
OPENAI_FIELDS = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream",
    "stream_options",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
]
FIELDS = {
    "/v1/chat/completions": OPENAI_FIELDS
    + ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format"],
    "/v1/completions": OPENAI_FIELDS + ["prompt", "logprobs", "echo", "suffix"],
    "/v1/messages": [
        "model",
        "max_tokens",
        "messages",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
    ],
}
INT64_MAX = 2**63 - 1

TEXT = st.text(max_size=16) | st.sampled_from(
    ["", "\ud800", "a\udfffb", "\x00", "</s>", "<|end|>", "\u202e", "🙂" * 3, "hello " * 50]
)
INTS = st.integers() | st.sampled_from([0, -1, 1, 2, 8, 9, 2**31, INT64_MAX, 2**63, 2**64, -(2**63) - 1, 10**400])
FLOATS = st.floats() | st.sampled_from(
    [1e308, -1e308, 5e-324, 1e-308, -0.0, 0.5, float("nan"), float("inf"), float("-inf")]
)
NUMBERS = INTS | FLOATS
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8
)
DEPTHS = st.sampled_from([50, 500, 950, 5_000, 100_000])
DEEP = re.compile(r'"\\u0000deep:(\d+)\\u0000"')  # a placeholder string, as json.dumps writes it


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


ANY = JSON_VALUES | DEPTHS.map("\x00deep:{}\x00".format)  # deep nesting is spliced in after encoding


def typed(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly values of the field's type (extreme ones included), sometimes anything at all."""
    return st.one_of(strategy, strategy, strategy, ANY)


ARGUMENTS = TEXT | st.just("{}") | DEPTHS.map(deep_json) | JSON_VALUES.map(json.dumps)
TOOL_CALL = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": TEXT, "arguments": ARGUMENTS})},
    optional={"id": TEXT, "type": typed(st.just("function"))},
)
CONTENT_PART = st.fixed_dictionaries(
    {"type": typed(st.sampled_from(["text", "image_url", "tool_use", "tool_result"]))},
    optional={"text": typed(TEXT), "input": ANY, "name": TEXT, "content": typed(TEXT)},
)
MESSAGE = st.fixed_dictionaries(
    {"role": typed(st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot", ""]))},
    optional={
        "content": typed(st.none() | TEXT | st.lists(CONTENT_PART, max_size=3)),
        "name": typed(TEXT),
        "tool_calls": typed(st.lists(TOOL_CALL, max_size=2)),
        "tool_call_id": typed(TEXT),
    },
)
TOOL = st.fixed_dictionaries(
    {
        "type": typed(st.just("function")),
        "function": st.fixed_dictionaries({"name": typed(TEXT)}, optional={"description": TEXT, "parameters": ANY}),
    }
)
LOGIT_BIAS_KEYS = st.sampled_from(["0", "5", "96", "97", "100000", "-1", "1e5", "abc", "", " 5", "٥", "9" * 30]) | TEXT
TOKEN_IDS = st.lists(st.integers(-5, 200) | INTS, max_size=5)
INT_FIELDS = ["max_tokens", "max_completion_tokens", "n", "seed", "min_tokens", "top_logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"]
BOOL_FIELDS = ["stream", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "echo"]
FIELD_VALUES: dict[str, st.SearchStrategy] = {
    **{name: typed(INTS) for name in INT_FIELDS},
    **{name: typed(NUMBERS) for name in FLOAT_FIELDS},
    **{name: typed(st.booleans()) for name in BOOL_FIELDS},
    "logprobs": typed(st.booleans() | INTS),
    "top_k": typed(INTS),
    "model": typed(st.just(MODEL) | TEXT),
    "messages": typed(st.lists(MESSAGE, max_size=3)),
    "prompt": typed(TEXT | st.lists(TEXT, max_size=3) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3)),
    "logit_bias": typed(st.dictionaries(LOGIT_BIAS_KEYS, typed(NUMBERS), max_size=3)),
    "stop": typed(TEXT | st.lists(TEXT, max_size=20)),
    "stop_sequences": typed(st.lists(TEXT, max_size=20)),
    "stop_token_ids": typed(TOKEN_IDS),
    "tools": typed(st.lists(TOOL, max_size=2)),
    "tool_choice": typed(
        st.sampled_from(["none", "auto", "required"])
        | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})})
    ),
    "system": typed(TEXT | st.lists(CONTENT_PART, max_size=2)),
    "stream_options": typed(st.fixed_dictionaries({"include_usage": typed(st.booleans())})),
    "response_format": typed(st.fixed_dictionaries({"type": st.just("text") | TEXT})),
    "user": typed(TEXT),
    "suffix": typed(TEXT),
}


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    """A valid body for ``path`` with a few fields replaced by hostile values (and maybe one removed),
    JSON-encoded with NaN/Infinity allowed."""
    body = dict(ENDPOINTS[path])
    for name in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3, unique=True)):
        body[name] = draw(FIELD_VALUES[name])
    removed = draw(st.sampled_from([None] * 4 + sorted(body)))
    body.pop(removed, None)
    return DEEP.sub(lambda match: deep_json(int(match[1])), json.dumps(body, allow_nan=True)).encode()


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b"1",
            b'"x"',
            b"{",
            b'{"model": NaN}',
            b'{"max_tokens": 1e999}',
            b'{"max_tokens": ' + b"9" * 5000 + b"}",
            deep_json(100_000).encode(),
            b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}',
        ]
    ),
    st.builds(lambda body, cut: body[:cut], bodies("/v1/completions"), st.integers(0, 40)),
    st.builds(
        lambda body, at, junk: body[:at] + junk + body[at:],
        bodies("/v1/chat/completions"),
        st.integers(0, 40),
        st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"]),
    ),
)
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("fuzz") / MODEL
    save_tiny_checkpoint(path, "llama", max_position_embeddings=512)
    engine = Engine(dtype="float32", model=str(path), num_kv_slots=1024, max_tokens_cap=8, max_n=2)
    with serve(engine) as live:
        yield live


@pytest.fixture(scope="module")
def client(fuzz_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        yield http


def assert_answered(response: httpx.Response) -> None:
    """No server error: not a 5xx, and no error event inside a 200 stream."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:1000]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert '"engine_error"' not in response.text and "event: error" not in response.text, response.text[-1000:]


FUZZ = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_malformed_bodies_never_cause_a_server_error(client: httpx.Client, path: str) -> None:
    @FUZZ
    @given(body=bodies(path))
    def fuzz(body: bytes) -> None:
        assert_answered(client.post(path, content=body, headers={"content-type": "application/json"}))

    fuzz()


@FUZZ
@given(path=st.sampled_from(list(ENDPOINTS)), body=RAW_BODIES, content_type=CONTENT_TYPES)
def test_raw_bytes_are_refused_cleanly(client: httpx.Client, path: str, body: bytes, content_type: str) -> None:
    response = client.post(path, content=body, headers={"content-type": content_type} if content_type else {})
    assert_answered(response)
    assert response.status_code in (400, 404, 413, 415), response.text  # 415: a form's body type (cross_site.py)


CHAT_START = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]'
HOSTILE = {  # id: (path, raw body, expected status)
    "nan": ("/v1/chat/completions", CHAT_START + b', "temperature": NaN}', 400),
    "infinity": ("/v1/chat/completions", CHAT_START + b', "top_p": Infinity}', 400),
    "1e308-max-tokens": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 1e308}', 400),
    "2**63-n": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "n": 9223372036854775808}', 400),
    "2**63-max-tokens": (
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 9223372036854775808}',
        400,
    ),
    "2**64-seed": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "seed": 18446744073709551616}', 400),
    "huge-n-streamed": (
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "hi", "stream": true, "n": 100000}',
        400,
    ),
    "logit-bias-oov": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "logit_bias": {"100000": 1}}', 400),
    "logit-bias-word": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "logit_bias": {"one": 1}}', 400),
    "surrogate-prompt": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi \\ud800"}', 400),
    "surrogate-chat": (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
    ),
    "surrogate-messages": (
        "/v1/messages",
        b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
    ),
    "no-messages": ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": []}', 400),
    "absent-messages": ("/v1/chat/completions", b'{"model": "tiny-llama"}', 400),
    "unknown-role": (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "robot", "content": "hi"}]}',
        400,
    ),
    "anthropic-system-role": (
        "/v1/messages",
        b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}',
        400,
    ),
    "deep-body": (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": ' + deep_json(50_000).encode() + b"}",
        400,
    ),
    "deep-tool-arguments": (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": '
        b'"assistant", "tool_calls": [{"function": {"name": "f", "arguments": "'
        + deep_json(100_000).encode()
        + b'"}}]}]}',
        400,  # JSON text nested deeper than MAX_NESTING_DEPTH
    ),
    "deep-tool-use-input": (
        "/v1/messages",
        b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", '
        b'"content": [{"type": "tool_use", "name": "f", "input": ' + deep_json(900).encode() + b"}]}]}",
        400,  # a body nested deeper than MAX_NESTING_DEPTH
    ),
    "invalid-utf8-key": ("/v1/chat/completions", CHAT_START + b', "\xff": 1}', 400),
}


@pytest.mark.parametrize("path, body, status", list(HOSTILE.values()), ids=list(HOSTILE))
def test_known_hostile_bodies(client: httpx.Client, path: str, body: bytes, status: int) -> None:
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text[:1000]


def test_top_k_outside_int64_is_a_400(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 1.0, "top_k": 2**63}
    assert client.post("/v1/completions", json=body).status_code == 400


def test_server_still_serves_after_the_fuzz(fuzz_server: Server, client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    for path, body in ENDPOINTS.items():
        assert client.post(path, json=body).status_code == 200
    stats = wait_until_idle(fuzz_server.engine)
    assert fuzz_server.engine.is_healthy()
    assert stats["free_rows"] == fuzz_server.engine.config.max_running_requests
