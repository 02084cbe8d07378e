"""A live server on loopback: a real engine on a tiny checkpoint, uvicorn in a background thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import Engine, SamplingParams
from tokenmill.request import RequestOutput, accumulate
from tokenmill.server.background import serve_in_background
from tokenmill.server.config import ServerConfig

MODEL = "tiny-llama"


@dataclass
class Server:
    engine: Engine
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def serve(engine: Engine, **options) -> Iterator[Server]:
    """Serve ``engine`` on a free loopback port with the ServerConfig ``options`` until the block ends;
    the engine is shut down after."""
    try:
        with serve_in_background(engine, ServerConfig(**options)) as port:
            yield Server(engine, port)
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / MODEL
    save_tiny_checkpoint(path, "llama", max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=8192, max_tokens_cap=400)) as live:
        yield live


def wait_until_idle(engine: Engine, timeout: float = 30) -> dict:
    """Poll ``engine.stats()`` until nothing runs and only the prefix cache holds KV pages."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        used = stats["kv_capacity_pages"] - stats["kv_free_pages"]
        if stats["running"] == stats["waiting"] == stats["active_requests"] == 0 and used == stats["kv_cached_pages"]:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.02)


def engine_generate(engine: Engine, prompt: str | list[int], params: SamplingParams) -> RequestOutput:
    """Ground truth: the engine's own complete output for ``prompt``, without the server."""
    done = threading.Event()
    total: list[RequestOutput | None] = [None]

    def on_output(delta: RequestOutput) -> None:
        total[0] = accumulate(total[0], delta)
        if delta.finished:
            done.set()

    engine.add_request(prompt, params, on_output)
    assert done.wait(60)
    return total[0]
