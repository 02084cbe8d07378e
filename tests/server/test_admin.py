"""RL control routes over HTTP: weight updates from disk (only from under the allowed roots, all or
nothing), pause/resume, the weight version, and the API key on all of them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.server.conftest import MODEL, Server, engine_generate, serve
from tests.tiny_models import save_tiny_checkpoint, save_tiny_model
from tokenmill import Engine, SamplingParams

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the cat sat on the mat"
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``root`` (the allowed root) holding good and bad checkpoints, and ``outside`` next to it."""
    base = tmp_path_factory.mktemp("admin")
    root, outside = base / "root", base / "outside"
    save_tiny_model(root / "first", "llama", seed=0, max_position_embeddings=512)  # the served model's weights
    save_tiny_checkpoint(root / "second", "llama", seed=1, max_position_embeddings=512)
    save_tiny_model(outside, "llama", seed=2, max_position_embeddings=512)
    save_tiny_model(root / "wrong-shapes", "llama", seed=3, intermediate_size=128)
    save_tiny_model(root / "non-finite", "llama", seed=4, max_position_embeddings=512)
    weights = load_file(root / "non-finite" / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][7, 3] = float("nan")
    save_file(weights, root / "non-finite" / "model.safetensors", metadata={"format": "pt"})
    pickled = root / "pickle-only"
    pickled.mkdir()
    (pickled / "config.json").write_text((root / "first" / "config.json").read_text())
    torch.save({"model.embed_tokens.weight": torch.zeros(97, 64)}, pickled / "pytorch_model.bin")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((root / "first" / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    escaping = root / "escaping-shards"  # an index whose shard lies outside the roots
    escaping.mkdir()
    (escaping / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../../outside/model.safetensors"}})
    )
    (root / "link").symlink_to(outside, target_is_directory=True)
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
def admin_server(checkpoint: Path, layout: dict[str, Path]) -> Iterator[Server]:
    engine = Engine(dtype="float32", model=str(checkpoint), num_kv_slots=2048)
    with serve(engine, api_key=KEY, allowed_weight_roots=[layout["root"]]) as live:
        yield live


def post(server: Server, path: str, body: dict | None = None, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def greedy_text(server: Server) -> str:
    response = post(server, "/v1/completions", GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def weight_version(server: Server) -> int:
    response = httpx.get(f"{server.url}/weight_version", headers=AUTH)
    assert response.status_code == 200
    return response.json()["weight_version"]


def update(server: Server, path: Path | str, headers: dict | None = AUTH, **options) -> httpx.Response:
    return post(server, "/update_weights_from_disk", {"model_path": str(path), **options}, headers)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_update_from_disk_switches_to_the_new_model_and_bumps_the_version(
    admin_server: Server, layout: dict[str, Path]
) -> None:
    second = Engine(dtype="float32", model=str(layout["root"] / "second"), num_kv_slots=256)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        expected = engine_generate(second, PROMPT, params).outputs[0].text
    finally:
        second.shutdown()
    before, version = greedy_text(admin_server), weight_version(admin_server)
    assert before != expected  # the test can tell the two models apart

    response = update(admin_server, layout["root"] / "second")
    assert response.status_code == 200, response.text
    assert response.json() == {"success": True, "weight_version": version + 1}
    assert weight_version(admin_server) == version + 1
    assert greedy_text(admin_server) == expected

    response = update(admin_server, layout["root"] / "first", version=version + 10, abort_running=True)
    assert response.json() == {"success": True, "weight_version": version + 10}
    assert greedy_text(admin_server) == before
    error = error_of(update(admin_server, layout["root"] / "second", version=version + 10), 400)
    assert error["param"] == "version" and "must increase" in error["message"]
    assert weight_version(admin_server) == version + 10 and greedy_text(admin_server) == before


@pytest.mark.parametrize("where", ["outside", "traversal", "symlink", "system", "shard"])
def test_paths_outside_the_allowed_roots_are_403(admin_server: Server, layout: dict[str, Path], where: str) -> None:
    root, outside = layout["root"], layout["outside"]
    path = {
        "outside": str(outside),
        "traversal": f"{root}/../{outside.name}",  # a valid checkpoint, reached through ..
        "symlink": str(root / "link"),
        "system": "/etc",
        "shard": str(root / "escaping-shards"),
    }[where]
    before, version = greedy_text(admin_server), weight_version(admin_server)
    error = error_of(update(admin_server, path), 403)
    assert error["code"] == "weight_path_forbidden" and "outside the allowed weight roots" in error["message"]
    assert weight_version(admin_server) == version and greedy_text(admin_server) == before


@pytest.mark.parametrize(
    "folder, message",
    [
        ("wrong-shapes", "has shape"),
        ("non-finite", "'model.layers.1.mlp.down_proj.weight' holds 1 non-finite value(s)"),
        ("pickle-only", "safetensors"),
        ("corrupt", "header"),
        ("does-not-exist", "no model.safetensors"),
        ("first/config.json", "no model.safetensors"),
        ("nul\x00byte", "cannot be resolved"),
    ],
)
def test_bad_checkpoints_are_400_and_change_nothing(
    admin_server: Server, layout: dict[str, Path], folder: str, message: str
) -> None:
    before, version = greedy_text(admin_server), weight_version(admin_server)
    error = error_of(update(admin_server, layout["root"] / folder), 400)
    assert error["code"] == "invalid_weights" and message in error["message"], error
    assert weight_version(admin_server) == version and greedy_text(admin_server) == before


@pytest.mark.parametrize("version", [2**63, -1, True, 1.5, "3"])
def test_bad_versions_are_400_and_change_nothing(admin_server: Server, layout: dict[str, Path], version) -> None:
    before, current = greedy_text(admin_server), weight_version(admin_server)
    error = error_of(update(admin_server, layout["root"] / "second", version=version), 400)
    assert error["param"] == "version", error
    assert weight_version(admin_server) == current and greedy_text(admin_server) == before


def test_pause_holds_a_request_until_resume(admin_server: Server) -> None:
    url = admin_server.url
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
    }

    async def stream(client: httpx.AsyncClient) -> list[str]:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            return [line async for line in response.aiter_lines() if line.startswith("data: ")]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            paused = await client.post(f"{url}/pause_generation", headers=AUTH)
            assert paused.json() == {"success": True, "paused": True}
            steps = admin_server.engine.stats()["scheduler"]["steps"]
            try:
                task = asyncio.create_task(stream(client))
                done, _ = await asyncio.wait({task}, timeout=0.5)
                assert not done, "a request made progress while generation was paused"
                assert admin_server.engine.stats()["scheduler"]["steps"] == steps
            finally:
                resumed = await client.post(f"{url}/resume_generation", headers=AUTH)
            assert resumed.json() == {"success": True, "paused": False}
            return await asyncio.wait_for(task, 30)

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]"
    finishes = [c["finish_reason"] for line in lines[:-1] for c in json.loads(line[6:])["choices"]]
    assert finishes[-1] == "length"


def test_admin_routes_need_the_api_key(admin_server: Server, layout: dict[str, Path]) -> None:
    version = weight_version(admin_server)
    routes = [
        ("POST", "/update_weights_from_disk", {"model_path": str(layout["root"] / "second")}),
        ("POST", "/pause_generation", None),
        ("POST", "/resume_generation", None),
        ("GET", "/weight_version", None),
    ]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            response = httpx.request(method, f"{admin_server.url}{path}", json=body, headers=headers)
            assert error_of(response, 401)["code"] == "invalid_api_key"
    assert not admin_server.engine.paused and weight_version(admin_server) == version


def test_without_allowed_roots_every_path_is_403(checkpoint: Path, layout: dict[str, Path]) -> None:
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=256)) as live:
        error = error_of(update(live, layout["root"] / "second", headers=None), 403)
        assert "--allowed-weight-roots" in error["message"]
        assert httpx.get(f"{live.url}/weight_version").json() == {"weight_version": 0}
