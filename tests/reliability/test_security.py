"""Security defaults: loopback bind, the API key on every route but /health, body size limit, server
caps, weights only from safetensors (never unpickled), weight paths only under the allowed roots,
and no remote code from a model folder."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.server.conftest import MODEL, Server, serve
from tests.tiny_models import save_tiny_checkpoint
from tokenmill import Engine
from tokenmill.cli import build_parser, config_from_args
from tokenmill.model.loader import load_model
from tokenmill.server.app import create_app
from tokenmill.server.config import ServerConfig

KEY = "k3y"
AUTH = {"x-api-key": KEY}
CAPS = {"max_n": 2, "max_tokens_cap": 8, "max_top_logprobs": 2, "max_stop_strings": 2}
BODY_LIMIT = 16 * 1024


class Planted:
    """Unpickling this creates ``path``: proof that a pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("security")
    good, pickled = base / "roots" / MODEL, base / "roots" / "pickle-only"
    save_tiny_checkpoint(good, "llama", max_position_embeddings=512)
    shutil.copytree(good, pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(base / "unpickled")))
    return {"base": base, "roots": base / "roots", "good": good, "pickled": pickled, "marker": base / "unpickled"}


@pytest.fixture(scope="module")
def guarded(models: dict[str, Path]) -> Iterator[Server]:
    engine = Engine(dtype="float32", model=str(models["good"]), num_kv_slots=1024, **CAPS)
    with serve(engine, api_key=KEY, max_body_bytes=BODY_LIMIT, allowed_weight_roots=[models["roots"]]) as live:
        yield live


@pytest.fixture(scope="module")
def client(guarded: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        yield http


def test_serve_binds_loopback_by_default() -> None:
    default = config_from_args(ServerConfig, build_parser().parse_args(["serve"]))
    assert default.host == "127.0.0.1"
    assert default.allowed_weight_roots == ()  # weight loading from disk is off
    args = build_parser().parse_args(["serve", "--allowed-weight-roots", "a", "b", "--shutdown-grace-seconds", "2.5"])
    config = config_from_args(ServerConfig, args)
    assert (config.allowed_weight_roots, config.shutdown_grace_seconds) == (("a", "b"), 2.5)


def test_every_route_but_health_needs_the_api_key(
    guarded: Server, client: httpx.Client, models: dict[str, Path]
) -> None:
    app = create_app(guarded.engine, ServerConfig(api_key=KEY, allowed_weight_roots=[models["roots"]]))
    paths = app.openapi()["paths"]  # every route of the app (the schema is built even though it is not served)
    routes = {(method.upper(), path) for path, operations in paths.items() for method in operations}
    assert {
        ("GET", "/metrics"),
        ("GET", "/status"),
        ("GET", "/version"),
        ("GET", "/v1/models"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/pause_generation"),
        ("POST", "/resume_generation"),
        ("GET", "/weight_version"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/messages"),
    } <= routes
    for method, path in sorted(routes):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": KEY + "x"}):
            response = client.request(method, path, headers=headers)
            expected = 200 if path == "/health" else 401
            assert response.status_code == expected, (method, path, headers, response.text)
        if method == "GET":
            assert client.get(path, headers=AUTH).status_code == 200, path
    assert client.get("/openapi.json").status_code in (401, 404)


@pytest.mark.parametrize(
    "path, at_cap, over, param",
    [
        ("/v1/chat/completions", {"n": 2}, {"n": 3}, "n"),
        ("/v1/chat/completions", {"max_tokens": 8}, {"max_tokens": 9}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 8}, {"max_completion_tokens": 9}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"logprobs": True, "top_logprobs": 2},
            {"logprobs": True, "top_logprobs": 3},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop"),
        ("/v1/completions", {"n": 2}, {"n": 3}, "n"),
        ("/v1/completions", {"max_tokens": 8}, {"max_tokens": 9}, "max_tokens"),
        ("/v1/completions", {"logprobs": 2}, {"logprobs": 3}, "logprobs"),
        ("/v1/completions", {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop"),
        ("/v1/messages", {"max_tokens": 8}, {"max_tokens": 9}, None),
        ("/v1/messages", {"stop_sequences": ["a", "b"]}, {"stop_sequences": ["a", "b", "c"]}, None),
    ],
)
def test_each_server_cap_is_a_400(client: httpx.Client, path: str, at_cap: dict, over: dict, param: str | None) -> None:
    messages = {"messages": [{"role": "user", "content": "hello"}]}
    base = {"model": MODEL, "max_tokens": 2, **({"prompt": "hello"} if path == "/v1/completions" else messages)}
    response = client.post(path, json={**base, **at_cap}, headers=AUTH)
    assert response.status_code == 200, response.text
    response = client.post(path, json={**base, **over}, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:  # Anthropic's error shape has no param
        assert error["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/update_weights_from_disk"])
def test_bodies_over_the_limit_are_413(client: httpx.Client, path: str) -> None:
    body = {"model": MODEL, "prompt": "hello " * BODY_LIMIT, "model_path": "x"}
    response = client.post(path, json=body, headers=AUTH)
    assert response.status_code == 413 and str(BODY_LIMIT) in response.json()["error"]["message"]


def test_weights_are_read_from_safetensors_only_never_unpickled(
    guarded: Server, client: httpx.Client, models: dict[str, Path]
) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors checkpoints only"):
        load_model(models["pickled"], torch.float32, "cpu")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Engine(dtype="float32", model=str(models["pickled"]), num_kv_slots=64)
    response = client.post("/update_weights_from_disk", json={"model_path": str(models["pickled"])}, headers=AUTH)
    assert response.status_code == 400 and "safetensors checkpoints only" in response.json()["error"]["message"]
    assert not models["marker"].exists()
    assert guarded.engine.weight_version == 0


def test_weight_updates_stay_inside_the_allowed_roots(
    guarded: Server, client: httpx.Client, models: dict[str, Path]
) -> None:
    outside = models["base"] / "outside"
    save_tiny_checkpoint(outside, "llama", max_position_embeddings=512)
    for path in (outside, f"{models['roots']}/../outside", "/", f"{models['good']}/../../outside"):
        response = client.post("/update_weights_from_disk", json={"model_path": str(path)}, headers=AUTH)
        assert response.status_code == 403, response.text
    assert guarded.engine.weight_version == 0


@pytest.mark.parametrize("tokenizer_class", [None, "EvilTokenizer"])
def test_no_remote_code_from_a_model_folder(models: dict[str, Path], tokenizer_class: str | None) -> None:
    """``auto_map`` and a custom tokenizer class in the folder: loaded with built-in classes, or
    refused; ``evil.py`` is never imported."""
    folder = models["base"] / f"remote-code-{tokenizer_class}"
    marker = models["base"] / f"imported-{tokenizer_class}"
    shutil.copytree(models["good"], folder)
    (folder / "evil.py").write_text(
        f"import os\nos.mkdir({str(marker)!r})\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast): pass\n"
        "class EvilConfig: pass\nclass EvilModel: pass\n"
    )
    auto_map = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModelForCausalLM": "evil.EvilModel",
        "AutoTokenizer": ["evil.EvilTokenizer", None],
    }
    for name, extra in (
        ("config.json", {}),
        ("tokenizer_config.json", {"tokenizer_class": tokenizer_class} if tokenizer_class else {}),
    ):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "auto_map": auto_map, **extra}))
    if tokenizer_class is None:
        engine = Engine(dtype="float32", model=str(folder), num_kv_slots=64)
        assert type(engine.tokenizer.hf).__module__.startswith("transformers.")
        engine.shutdown()
    else:
        with pytest.raises(FileNotFoundError, match="cannot load a tokenizer"):
            Engine(dtype="float32", model=str(folder), num_kv_slots=64)
    assert not marker.exists()
