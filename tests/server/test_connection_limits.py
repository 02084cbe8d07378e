"""Bounded work per connection, against a live server on loopback, spoken to over raw sockets.

An unauthenticated request is answered 401 from its headers alone; headers that never finish, a
body that never finishes and an idle connection are each cut after their timeout; a chunked body
over the size cap is refused while it streams in; connections over the cap get 503; a half-sent
body cannot hold a graceful shutdown past its grace period; and running out of file descriptors
logs one traceback, not one per accept retry.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tokenmill
from tests.server.conftest import MODEL, Server, serve
from tokenmill import Engine
from tokenmill.cli import build_parser, config_from_args
from tokenmill.request import ParameterError
from tokenmill.server.background import serve_in_background
from tokenmill.server.config import ServerConfig
from tokenmill.server.http.log_throttle import LogThrottle

KEY = "secret-key"
AUTH = f"Authorization: Bearer {KEY}\r\n"
SHORT = 1.0  # seconds: the header, body and keep-alive timeouts of the `guarded` server
MAX_BODY = 4096
WAIT_S = 30.0  # how long a test waits for the server before calling it hung
REPO_ROOT = Path(tokenmill.__file__).resolve().parents[1]


def tiny_engine(checkpoint: Path) -> Engine:
    return Engine(dtype="float32", model=str(checkpoint), num_kv_slots=1024)


@pytest.fixture(scope="module")
def guarded(checkpoint: Path) -> Iterator[Server]:
    limits = {"header_timeout_seconds": SHORT, "body_timeout_seconds": SHORT, "keep_alive_timeout_seconds": SHORT}
    with serve(tiny_engine(checkpoint), **limits, api_key=KEY, max_body_bytes=MAX_BODY) as live:
        yield live


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)


def read_response(sock: socket.socket, data: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response with a Content-Length (``data``: its start, if read)."""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-response"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (reads end), False if it is still open after WAIT_S."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def post_head(path: str, content_length: int | None, auth: str = AUTH) -> bytes:
    length = f"Content-Length: {content_length}\r\n" if content_length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}{length}\r\n".encode()


# ------------------------------------------------------------------------------------------ settings
def test_limits_come_from_the_command_line_and_bad_ones_are_refused() -> None:
    args = build_parser().parse_args(["serve", "--header-timeout-seconds", "2.5", "--max-requests-in-progress", "7"])
    assert config_from_args(ServerConfig, args) == ServerConfig(header_timeout_seconds=2.5, max_requests_in_progress=7)
    assert config_from_args(ServerConfig, build_parser().parse_args(["serve"])) == ServerConfig()
    for bad in (
        {"body_timeout_seconds": 0},
        {"keep_alive_timeout_seconds": float("inf")},
        {"max_requests_in_progress": 1.5},
        {"max_arriving_body_bytes": 1000},  # under max_body_bytes: a body of the allowed size could never arrive
    ):
        with pytest.raises(ParameterError) as refused:
            ServerConfig(**bad)
        assert refused.value.param == next(iter(bad))


# ------------------------------------------------------------------------------------ authentication
@pytest.mark.parametrize("length", [MAX_BODY, 1_000_000], ids=["within-the-cap", "over-the-cap"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/update_weights_from_disk"])
def test_an_unauthenticated_body_is_never_waited_for(guarded: Server, path: str, length: int) -> None:
    with connect(guarded) as sock:
        sock.sendall(post_head(path, length, auth=""))  # announces a body, sends none of it
        status, headers, body = read_response(sock)
        assert status == 401 and headers["connection"] == "close"
        error = json.loads(body)
        if path == "/v1/messages":
            assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
        else:
            assert error["error"]["code"] == "invalid_api_key"
        assert closed_by_server(sock)


def test_health_stays_open_without_the_key(guarded: Server) -> None:
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/version").status_code == 401
    assert httpx.get(f"{guarded.url}/version", headers={"x-api-key": KEY}).status_code == 200


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_headers_over_the_byte_cap_get_400_however_they_arrive(guarded: Server, pieces: int) -> None:
    """A header block over ``max_header_bytes`` (16 KiB by default) is refused whether it arrives in
    one read or in pieces whose last completes it; a kept-alive connection's next request is counted
    afresh, and a block just under the cap is served."""
    cap = ServerConfig().max_header_bytes
    under = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {'a' * (cap - 100)}\r\n\r\n".encode()
    with connect(guarded) as sock:
        for _ in range(2):
            sock.sendall(under)
            status, _, _ = read_response(sock)
            assert status == 200
    over = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {'a' * (cap + 100)}\r\n\r\n".encode()
    with connect(guarded) as sock:
        step = -(-len(over) // pieces)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the server may close before the end
            for start in range(0, len(over), step):
                sock.sendall(over[start : start + step])
                time.sleep(0.05)
        status, _, body = read_response(sock)
        assert status == 400 and b"exceed" in body
        assert closed_by_server(sock)


# ------------------------------------------------------------------------------------------ timeouts
def test_headers_sent_a_byte_at_a_time_are_cut(guarded: Server) -> None:
    """Slowloris: each byte well inside any per-read timeout, the headers never complete."""
    head = post_head("/v1/completions", 10)
    sent = 0
    with connect(guarded) as sock:
        try:
            for byte in head[:-2]:  # never the final blank line
                sock.sendall(bytes([byte]))
                sent += 1
                time.sleep(SHORT / 10)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < len(head) - 2, "the server let a slow client send all its headers"
        assert closed_by_server(sock)


def test_a_connection_that_sends_nothing_is_cut(guarded: Server) -> None:
    with connect(guarded) as sock:
        assert closed_by_server(sock)


def test_an_idle_kept_alive_connection_is_cut(guarded: Server) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection") != "close"
        assert closed_by_server(sock)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_body_that_stops_arriving_gets_408(guarded: Server, path: str) -> None:
    with connect(guarded) as sock:
        sock.sendall(post_head(path, 100) + b'{"model": ')
        status, headers, body = read_response(sock)
        assert status == 408 and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert "did not arrive within" in error["message"]
        assert closed_by_server(sock)


def test_bodies_still_arriving_share_a_byte_budget(checkpoint: Path) -> None:
    """Slow senders cannot make the server buffer ``max_body_bytes`` each: once bodies still arriving
    hold ``max_arriving_body_bytes``, a further body gets 503 with Retry-After (the API's error shape);
    a body that completes stops counting, so later requests are served."""

    def body_of(size: int) -> bytes:
        head = f'{{"model": "{MODEL}", "max_tokens": 1, "prompt": "'.encode()
        return head + b"a" * (size - len(head) - 2) + b'"}'

    with serve(
        tiny_engine(checkpoint), api_key=KEY, max_body_bytes=MAX_BODY, max_arriving_body_bytes=2 * MAX_BODY
    ) as live:
        slow, body = [connect(live) for _ in range(2)], body_of(MAX_BODY)
        try:
            for sock in slow:  # each holds all but 96 bytes of its body
                sock.sendall(post_head("/v1/completions", len(body)) + body[:-96])
            time.sleep(0.3)
            with connect(live) as third:
                third.sendall(post_head("/v1/completions", len(body)) + body[:-96])
                status, headers, reply = read_response(third)
            assert status == 503 and headers["retry-after"] == "1", reply
            assert "still arriving" in json.loads(reply)["error"]["message"]
            slow[0].sendall(body[-96:])
            assert read_response(slow[0])[0] == 200
            with connect(live) as fourth:
                fourth.sendall(post_head("/v1/completions", len(body)) + body)
                assert read_response(fourth)[0] == 200
        finally:
            for sock in slow:
                sock.close()


def test_a_chunked_body_over_the_cap_is_refused_while_it_streams(guarded: Server) -> None:
    chunk = b"x" * 512
    sent = 0
    with connect(guarded) as sock:
        sock.sendall(post_head("/v1/completions", None))
        sock.settimeout(0.05)
        response = b""
        while not response and sent < 100 * MAX_BODY:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                response = sock.recv(65536)
            except TimeoutError:
                continue
        sock.settimeout(WAIT_S)
        status, headers, body = read_response(sock, response)
        assert status == 413 and headers["connection"] == "close"
        assert MAX_BODY < sent < 10 * MAX_BODY
        assert json.loads(body)["error"]["code"] == "request_too_large"


# ------------------------------------------------------------------------------------ connection cap
def test_idle_connections_do_not_count_and_health_always_answers(checkpoint: Path) -> None:
    """Idle connections (no byte sent) never fill the cap; a request beyond the requests in progress
    gets 503 in the API's error shape; /health answers even then."""
    with serve(tiny_engine(checkpoint), max_requests_in_progress=2) as server:
        idle = [connect(server) for _ in range(6)]
        try:
            assert httpx.get(f"{server.url}/health").status_code == 200
            assert httpx.get(f"{server.url}/v1/models").status_code == 200  # six idle connections: no request
            holders = [connect(server) for _ in range(2)]
            for sock in holders:  # two requests in progress: their bodies never finish arriving
                sock.sendall(post_head("/v1/completions", 100, auth="") + b'{"model": ')
            time.sleep(0.3)
            over = httpx.get(f"{server.url}/v1/models")
            assert over.status_code == 503 and over.headers["retry-after"]
            assert over.json()["error"]["code"] == "server_overloaded"
            assert httpx.get(f"{server.url}/health").status_code == 200
            for sock in holders:
                sock.close()
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + WAIT_S
        while httpx.get(f"{server.url}/v1/models").status_code != 200:  # the held requests end with their sockets
            assert time.monotonic() < deadline
            time.sleep(0.1)


# ------------------------------------------------------------------------------------------ shutdown
def test_a_half_sent_body_is_cut_at_the_end_of_the_grace_period(checkpoint: Path) -> None:
    grace = 1.0
    engine = tiny_engine(checkpoint)
    answers: list[bytes] = []
    try:
        with serve_in_background(engine, ServerConfig(shutdown_grace_seconds=grace)) as port:
            sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
            sock.sendall(post_head("/v1/completions", 100, auth="") + b'{"model": "tiny-llama", ')
            time.sleep(0.2)  # the request is in flight, waiting for the rest of its body

            def read_answer() -> None:
                answers.append(b"".join(iter(lambda: sock.recv(65536), b"")))

            reader = threading.Thread(target=read_answer)
            reader.start()
            started = time.monotonic()
        stopped = time.monotonic() - started
        reader.join(WAIT_S)
        sock.close()
    finally:
        engine.shutdown()
    assert answers and answers[0].startswith(b"HTTP/1.1 503"), answers
    assert "shutting down" in json.loads(answers[0].partition(b"\r\n\r\n")[2])["error"]["message"]
    assert stopped < grace + 2.0, f"the shutdown took {stopped:.1f} s with a grace period of {grace} s"


# ---------------------------------------------------------------------------------------- log floods
def test_repeated_messages_are_throttled_with_a_count() -> None:
    throttle = LogThrottle(("socket.accept() out of system resource",), interval_s=0.5)
    logger = logging.getLogger("asyncio")
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect()
    installed = logger.filters
    logger.filters = [throttle]  # in place of the server's (10 s) throttle, if a server installed it
    logger.addHandler(handler)
    try:
        for _ in range(5):
            logger.error("socket.accept() out of system resource\nsocket: <fd=%d>", 7)
        logger.error("something else")
        time.sleep(0.6)
        logger.error("socket.accept() out of system resource\nsocket: <fd=%d>", 7)
    finally:
        logger.filters = installed
        logger.removeHandler(handler)
    messages = [record.getMessage() for record in records]
    assert len(messages) == 3, messages
    assert messages[0] == "socket.accept() out of system resource\nsocket: <fd=7>"
    assert messages[1] == "something else"
    assert messages[2].startswith("socket.accept() out of system resource")
    assert "[4 more like this in the last" in messages[2]


OUT_OF_FDS_SERVER = textwrap.dedent(
    """
    import resource, socket, sys, time
    from tokenmill import Engine
    from tokenmill.server.background import serve_in_background

    engine = Engine(dtype="float32", model=sys.argv[1], num_kv_slots=1024)
    with serve_in_background(engine) as port:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        in_use = len(__import__("os").listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 2, hard))
        print(port, flush=True)
        sys.stdin.readline()  # the client has held its connections for a while
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        time.sleep(1.5)  # the listener's accept retry comes back
        with socket.create_connection(("127.0.0.1", port)) as probe:
            probe.sendall(b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n")
            print(probe.recv(100).split(b"\\r\\n")[0].decode(), flush=True)
    engine.shutdown()
    """
)


def test_running_out_of_file_descriptors_logs_one_traceback(checkpoint: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", OUT_OF_FDS_SERVER, str(checkpoint)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    try:
        port = int(process.stdout.readline())
        held = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(8)]
        time.sleep(3.5)  # the listener retries accept() once a second
        for sock in held:
            sock.close()
        stdout, stderr = process.communicate("go\n", timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert stdout.strip() == "HTTP/1.1 200 OK", (stdout, stderr)  # it serves again once descriptors are free
    assert stderr.count("socket.accept() out of system resource") == 1, stderr
    assert stderr.count("Traceback") == 1, stderr
