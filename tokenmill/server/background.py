"""Serve an engine from a background thread on a free loopback port (tests, benchmarks, notebooks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from tokenmill.engine.engine import Engine
from tokenmill.server.app import create_app


@contextlib.contextmanager
def serve_in_background(engine: Engine, start_timeout: float = 60.0, **app_options: Any) -> Iterator[int]:
    """Run uvicorn on 127.0.0.1 for the duration of the block; yields the port.

    The server is stopped when the block ends; the engine is left to the caller.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(create_app(engine, **app_options), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="tokenmill-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)
