"""``tokenmill serve --tensor-parallel-size 2`` run as a user runs it (a subprocess on a free port),
through the official ``openai`` client: greedy chat equal to tp=1, streaming, a client leaving
mid-stream, ``/health``; then a hung worker (SIGSTOP) fails the stream in flight within the
collective timeout and turns ``/health`` unhealthy, and SIGTERM still exits 0 leaving no process.

One server for the module (spawning one costs seconds); the hung-worker test ends it. Then the same
server started by torchrun (every rank launched by it, as on several machines).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.tokenizer import Tokenizer

MODEL = "tiny-llama"
MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world"}]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
COLLECTIVE_TIMEOUT_S = 3
WAIT_S = 120  # bounds a wait that only a broken server reaches


@dataclass
class Served:
    process: subprocess.Popen[str]
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def tokenmill_command() -> list[str]:
    script = Path(sys.executable).with_name("tokenmill")
    return [str(script)] if script.is_file() else [shutil.which("tokenmill") or "tokenmill"]


def descendants(pid: int) -> list[int]:
    """Every live (not zombie) process below ``pid``."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_pid(served: Served) -> int:
    (pid,) = [p for p in descendants(served.process.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / MODEL
    save_tiny_checkpoint(path, "llama", max_position_embeddings=512)
    return path


@contextlib.contextmanager
def started(command: list[str]) -> Iterator[Served]:
    """Run ``command`` (a server) until the block ends; then kill what is left of it."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    listening = threading.Event()
    port: list[int] = []

    def read_log() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if match:
                port.append(int(match.group(1)))
                listening.set()
        listening.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        assert listening.wait(WAIT_S) and port, "".join(log)
        yield Served(process, port[0], log)
    finally:
        for pid in [*descendants(process.pid), process.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def serve_args(checkpoint: Path) -> list[str]:
    return ["serve", "--model", str(checkpoint), "--port", "0", "--tensor-parallel-size", "2"] + [
        *("--distributed-timeout-s", str(COLLECTIVE_TIMEOUT_S), "--dtype", "float32", "--num-kv-slots", "2048"),
        *("--shutdown-grace-seconds", "1"),
    ]


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[Served]:
    with started([*tokenmill_command(), *serve_args(checkpoint)]) as live:
        yield live


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def tp1_text(checkpoint: Path, max_tokens: int) -> str:
    prompt = Tokenizer(checkpoint).apply_chat_template(MESSAGES)
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_slots=2048)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()


def engine_load(served: Served) -> dict[str, float]:
    """The running/waiting/KV-usage gauges of ``/metrics``."""
    text = httpx.get(f"{served.url}/metrics").text
    wanted = {"tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_ratio"}
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in wanted}


def test_health_and_greedy_chat_equal_tp1(served: Served, client: openai.OpenAI, checkpoint: Path) -> None:
    assert httpx.get(f"{served.url}/health").status_code == 200
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    assert reply.choices[0].message.content == tp1_text(checkpoint, 12)
    assert reply.usage.completion_tokens == 12


def test_stream_concatenates_to_the_full_reply(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_client_leaving_mid_stream_aborts_its_request(served: Served, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, stream=True, **GREEDY)
    next(stream), next(stream)
    stream.close()
    deadline = time.monotonic() + WAIT_S
    while any(engine_load(served).values()):
        assert time.monotonic() < deadline, engine_load(served)
        time.sleep(0.05)
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_hung_worker_fails_the_stream_turns_unhealthy_and_sigterm_leaves_no_process(
    served: Served, client: openai.OpenAI
) -> None:
    """Ends the module's server."""
    worker, processes = worker_pid(served), descendants(served.process.pid)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, stream=True, **GREEDY)
    next(stream)
    os.kill(worker, signal.SIGSTOP)
    with pytest.raises(openai.APIError, match="collective"):  # after the collective timeout, not the client's
        for _ in stream:
            pass
    assert httpx.get(f"{served.url}/health").status_code == 503
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(WAIT_S) == 0, "".join(served.log)
    assert not alive(worker)  # killed by the server, not by its exit
    deadline = time.monotonic() + WAIT_S  # multiprocessing's resource tracker exits once it sees its parent gone
    while [pid for pid in processes if alive(pid)]:
        assert time.monotonic() < deadline, [pid for pid in processes if alive(pid)]
        time.sleep(0.05)


def test_torchrun_launch_serves_the_tp1_text_and_ends_cleanly(checkpoint: Path) -> None:
    """Every rank started by torchrun (one machine here, as ``--nnodes 1``): rank 0 serves, rank 1 is a
    worker; SIGTERM to the server drains it, stops the worker, and torchrun exits 0."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"]
    with started([*torchrun, "--no-python", *tokenmill_command(), *serve_args(checkpoint)]) as served:
        processes = descendants(served.process.pid)
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
        assert reply.choices[0].message.content == tp1_text(checkpoint, 12)
        (server,) = [int(m) for line in served.log for m in re.findall(r"Started server process \[(\d+)\]", line)]
        os.kill(server, signal.SIGTERM)
        assert served.process.wait(WAIT_S) == 0, "".join(served.log)
        deadline = time.monotonic() + WAIT_S  # the resource tracker exits once it sees its parent gone
        while [pid for pid in processes if alive(pid)]:
            assert time.monotonic() < deadline, [pid for pid in processes if alive(pid)]
            time.sleep(0.05)
