"""CORS over HTTP: off by default; with ``allowed_origins`` a browser's preflight and its request
from an allowed origin get the CORS headers (before the API-key check), other origins do not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL, Server, serve
from tokenmill import Engine
from tokenmill.cli import build_parser

APP = "http://app.example"
KEY = "k3y"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def preflight(server: Server, origin: str = APP) -> httpx.Response:
    return httpx.options(f"{server.url}/v1/chat/completions", headers={**PREFLIGHT, "Origin": origin}, timeout=30)


def chat(server: Server, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"Origin": APP, **headers}, timeout=30)


@pytest.fixture(scope="module")
def cors_server(checkpoint: Path) -> Iterator[Server]:
    engine = Engine(dtype="float32", model=str(checkpoint), num_kv_slots=256)
    with serve(engine, api_key=KEY, allowed_origins=[APP]) as live:
        yield live


def test_an_allowed_origin_gets_cors_headers_before_the_key_check(cors_server: Server) -> None:
    answer = preflight(cors_server)  # browsers send no credentials in a preflight
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == APP
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    reply = chat(cors_server, Authorization=f"Bearer {KEY}")
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == APP
    refused = chat(cors_server)  # the key is still required, and the browser may read why
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP


def test_another_origin_gets_no_cors_headers(cors_server: Server) -> None:
    answer = preflight(cors_server, origin="http://evil.example")
    assert answer.status_code == 400 and "access-control-allow-origin" not in answer.headers
    reply = chat(cors_server, Authorization=f"Bearer {KEY}", Origin="http://evil.example")
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers


def test_cors_is_off_by_default(server: Server) -> None:
    answer = preflight(server)
    assert answer.status_code == 405 and "access-control-allow-origin" not in answer.headers
    reply = chat(server)  # a keyless server refuses another site's request (test_cross_site.py)
    assert reply.status_code == 403 and "access-control-allow-origin" not in reply.headers
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30)  # no browser: no Origin
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_serve_takes_origins_repeated_or_comma_separated() -> None:
    args = build_parser().parse_args(
        ["serve", "--allowed-origins", f"{APP},http://b.example", "--allowed-origins", "*"]
    )
    assert args.allowed_origins == [APP, "http://b.example", "*"] and args.allowed_methods is None
