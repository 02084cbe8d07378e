"""The chat page at ``/``, driven in a real browser (Playwright with Debian's chromium) against a live
server on loopback: a streamed answer appears, a stopped answer stops the request on the server,
model text that looks like HTML stays text, the page asks for the API key where the server needs
one, and the status tab shows the server's state. Without ``chromium`` (``apt-get install
chromium``; ``.ci/run`` installs it) the browser tests are skipped; the route tests run anyway.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, serve
from tests.server.scripted_model import SCRIPT, VOCAB, save_scripted_checkpoint
from tokenmill import Engine

SCRIPT_TAG = "<script>window.pwned=1</script>"
IMG_TAG = "<img/src=x/onerror=window.pwned=2>"
ANSWER_LOOP = ["hello", SCRIPT_TAG, IMG_TAG, "world"]
"""The model's answer to any chat: these words, over and over, until max_tokens."""
KEY = "page-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "looping"
    loop = dict(zip(ANSWER_LOOP, ANSWER_LOOP[1:] + ANSWER_LOOP[:1]))
    save_scripted_checkpoint(
        path, VOCAB + [SCRIPT_TAG, IMG_TAG], {**SCRIPT, ":": "hello", **loop}, max_position_embeddings=32768
    )
    return path


def engine(checkpoint: Path) -> Engine:
    return Engine(dtype="float32", model=str(checkpoint), num_kv_slots=32768)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    with serve(engine(checkpoint)) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield instance
        instance.close()


@pytest.fixture
def page(browser, server: Server) -> Iterator[object]:  # noqa: ANN001 - playwright's Browser
    context = browser.new_context(viewport={"width": 1100, "height": 700})
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()


def chat(page, url: str, text: str, max_tokens: int) -> None:  # noqa: ANN001 - playwright's Page
    page.goto(url)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")


def test_a_streamed_answer_appears_with_its_timing(page, server: Server, tmp_path: Path) -> None:  # noqa: ANN001
    chat(page, server.url, "Say hello", max_tokens=8)
    answer = page.locator(".message.assistant").last
    answer.locator(".meta").filter(has_text="TTFT").wait_for()
    words = answer.locator(".body").inner_text().split()
    assert words == (ANSWER_LOOP * 2)[:8]
    assert "8 tokens" in answer.locator(".meta").inner_text()
    page.screenshot(path=str(tmp_path / "chat-page.png"))
    if os.environ.get("TOKENMILL_WEB_SCREENSHOT"):  # the README's picture
        shutil.copy(tmp_path / "chat-page.png", os.environ["TOKENMILL_WEB_SCREENSHOT"])


def test_model_text_that_looks_like_html_stays_text(page, server: Server) -> None:  # noqa: ANN001
    chat(page, server.url, "Say hello", max_tokens=4)
    answer = page.locator(".message.assistant").last
    answer.locator(".meta").filter(has_text="TTFT").wait_for()
    assert SCRIPT_TAG in answer.inner_text() and IMG_TAG in answer.inner_text()
    assert answer.locator("script, img").count() == 0
    assert page.evaluate("window.pwned") is None


def test_stop_ends_the_request_on_the_server(page, server: Server) -> None:  # noqa: ANN001
    """Stop is pressed while the server is still generating (30,000 tokens asked for): the page says
    so, and the server's request ends at once, long before its tokens would have."""
    chat(page, server.url, "Keep going", max_tokens=30_000)
    answer = page.locator(".message.assistant").last
    answer.locator(".body p").first.wait_for()  # streaming
    assert server.engine.stats()["running"] == 1, "the answer ended before stop could be pressed"
    page.click("#stop")
    answer.locator(".meta").filter(has_text="stopped").wait_for()
    deadline = time.monotonic() + 30
    while server.engine.stats()["running"] or server.engine.stats()["active_requests"]:
        assert time.monotonic() < deadline, "the server kept generating after stop"
        time.sleep(0.05)
    assert len(answer.locator(".body").inner_text().split()) < 30_000


def test_a_server_error_shows_in_the_conversation(page, server: Server) -> None:  # noqa: ANN001
    chat(page, server.url, "Say hello", max_tokens=0)
    error = page.locator(".message.error").last
    error.wait_for()
    assert "max_tokens must be >= 1, got 0" in error.inner_text()
    page.fill("#max-tokens", "4")  # the page goes on working
    page.fill("#prompt", "Say hello")
    page.click("#send")
    page.locator(".message.assistant .meta", has_text="TTFT").wait_for()


def test_the_status_tab_shows_the_server(page, server: Server) -> None:  # noqa: ANN001
    page.goto(server.url)
    page.click("#tab-status")
    table = page.locator("#status-table")
    table.locator("td", has_text="Attention backend").wait_for()
    text = table.inner_text()
    assert "looping" in text and "float32" in text and "KV pages free" in text


def test_the_page_asks_for_the_key_and_says_when_it_is_wrong(browser, checkpoint: Path) -> None:  # noqa: ANN001
    with serve(engine(checkpoint), api_key=KEY) as live:
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(30_000)
        try:
            page.goto(live.url)
            page.locator("#key-dialog").wait_for(state="visible")
            page.fill("#key-input", "wrong")
            page.click("#key-save")
            page.locator("#key-message", has_text="was refused").wait_for(state="visible")
            page.fill("#key-input", KEY)
            page.click("#key-save")
            page.locator("#model-name", has_text="looping").wait_for()
            page.fill("#max-tokens", "4")
            page.fill("#prompt", "Say hello")
            page.click("#send")
            page.locator(".message.assistant .meta", has_text="TTFT").wait_for()
        finally:
            context.close()


def test_the_page_is_open_without_the_key_and_off_with_no_web_ui(checkpoint: Path) -> None:
    with serve(engine(checkpoint), api_key=KEY) as live:
        for path in ("/", "/web/app.js", "/web/style.css", "/web/favicon.svg", "/favicon.ico"):
            assert httpx.get(live.url + path).status_code == 200, path  # the icon too: no 404 in the console
        assert httpx.get(live.url + "/favicon.ico").headers["content-type"] == "image/svg+xml"
        assert httpx.get(live.url + "/status").status_code == 401
        status = httpx.get(live.url + "/status", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert status["model"] == "looping" and status["running"] == 0 and status["kv_pages_free"] > 0
        for escape in ("/web/%2e%2e/page.py", "/web/%2e%2e/%2e%2e/config.py", "/web/..%2fpage.py"):
            assert httpx.get(live.url + escape).status_code == 404, escape  # open, yet nothing outside static/
    with serve(engine(checkpoint), web_ui=False) as live:
        assert httpx.get(live.url + "/").status_code == 404
        assert httpx.get(live.url + "/web/app.js").status_code == 404
