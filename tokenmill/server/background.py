"""Serve an engine from a background thread on a free loopback port (tests, benchmarks, notebooks).

The server is the one ``run_server`` runs (:func:`~tokenmill.server.lifecycle.build_server`): the
same connection limits, and the same graceful drain when the block ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

from tokenmill.engine.engine import Engine
from tokenmill.server.config import ServerConfig
from tokenmill.server.lifecycle import SHUTDOWN_BACKSTOP_S, build_server


@contextlib.contextmanager
def serve_in_background(
    engine: Engine, config: ServerConfig = ServerConfig(), start_timeout: float = 60.0
) -> Iterator[int]:
    """Run the server on 127.0.0.1 for the duration of the block, as ``config`` says but on a free port
    (``config.host`` and ``config.port`` are not used); yields the port.

    When the block ends the server shuts down gracefully (requests in flight get
    ``config.shutdown_grace_seconds``); the engine is left to the caller.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = build_server(engine, dataclasses.replace(config, host="127.0.0.1", port=port), log_level="warning")
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
        thread.join(config.shutdown_grace_seconds + SHUTDOWN_BACKSTOP_S + 30)
