"""Another site's page cannot drive a server through the user's browser (#62): a Host name the server
does not answer to (DNS rebinding), a keyless server's state-changing request from another origin,
and the body types a form can send are refused before any route runs; the chat page forbids frames
and foreign content. Real servers on 127.0.0.1, requests as a browser would send them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, Server, serve
from tokenmill import Engine

EVIL = "http://evil.example"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyless(checkpoint: Path) -> Iterator[Server]:
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=256)) as live:
        yield live


def post(server: Server, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)  # type: ignore[arg-type]


def test_a_rebound_host_name_is_refused(keyless: Server) -> None:
    for path in ("/v1/models", "/", "/status"):
        refused = httpx.get(f"{keyless.url}{path}", headers={"Host": f"evil.example:{keyless.port}"}, timeout=30)
        assert refused.status_code == 400 and "Host" in refused.json()["error"]["message"], path
    for host in (f"localhost:{keyless.port}", f"127.0.0.1:{keyless.port}", "localhost"):
        assert httpx.get(f"{keyless.url}/v1/models", headers={"Host": host}, timeout=30).status_code == 200, host
    refused = post(keyless, "/pause_generation", headers={"Host": "evil.example"})
    assert refused.status_code == 400 and not keyless.engine.paused


def test_another_sites_form_or_fetch_changes_nothing(keyless: Server) -> None:
    """What a page on another site can make a browser send without a CORS preflight."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    attempts = [
        ("/pause_generation", {"headers": {"Origin": EVIL, **form}, "content": b"x=1"}, 403),
        ("/pause_generation", {"headers": {"Origin": EVIL}}, 403),  # fetch(url, {method: "POST", mode: "no-cors"})
        ("/reset_prefix_cache", {"headers": {"Origin": EVIL, "Content-Type": "text/plain"}, "content": b"{}"}, 403),
        ("/v1/chat/completions", {"headers": {"Origin": EVIL, "Content-Type": "text/plain"}, "json": CHAT}, 403),
        ("/pause_generation", {"headers": {"Content-Type": "multipart/form-data; boundary=x"}, "content": b""}, 415),
        ("/v1/chat/completions", {"headers": form, "content": b"model=x"}, 415),
    ]
    for path, kwargs, status in attempts:
        reply = post(keyless, path, **kwargs)
        assert reply.status_code == status, (path, kwargs, reply.text)
        assert not keyless.engine.paused
    own = post(keyless, "/pause_generation", headers={"Origin": keyless.url})  # the chat page itself
    assert own.status_code == 200 and keyless.engine.paused
    assert post(keyless, "/resume_generation").status_code == 200 and not keyless.engine.paused  # curl -X POST


def test_clients_that_are_not_browsers_are_unaffected(keyless: Server) -> None:
    client = openai.OpenAI(base_url=f"{keyless.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
    assert reply.choices[0].message.content is not None


def test_a_keyed_server_takes_a_keyed_request_from_any_origin(checkpoint: Path) -> None:
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=256), api_key="k") as live:
        reply = post(live, "/v1/chat/completions", json=CHAT, headers={"Origin": EVIL, "Authorization": "Bearer k"})
        assert reply.status_code == 200  # another site's page cannot know the key


def test_allowed_hosts_names_the_hosts(checkpoint: Path) -> None:
    engine = Engine(dtype="float32", model=str(checkpoint), num_kv_slots=256)
    with serve(engine, allowed_hosts=["llm.internal"]) as live:
        assert httpx.get(f"{live.url}/v1/models", headers={"Host": "llm.internal:8000"}, timeout=30).status_code == 200
        assert httpx.get(f"{live.url}/v1/models", timeout=30).status_code == 400  # 127.0.0.1 is not named


def test_the_chat_page_forbids_frames_and_foreign_content(keyless: Server) -> None:
    page = httpx.get(f"{keyless.url}/", timeout=30)
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
