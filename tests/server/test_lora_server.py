"""LoRA adapters over HTTP with the official ``openai`` and ``anthropic`` clients (and httpx for
vLLM's adapter routes): the ``model`` field picks an adapter, outputs equal PEFT's merged model,
``/v1/models`` lists adapters, adapters load and unload at run time under the allowed roots, and
unknown names are 404 ``model_not_found``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.engine.test_lora import ALL_PROJECTIONS, hf_greedy, save_adapter
from tests.server.conftest import MODEL, Server, serve
from tests.tiny_models import make_hf_model
from tokenmill import Engine


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("adapters")
    oracles = {
        "a": save_adapter(make_hf_model("llama", max_position_embeddings=512), root / "a", 1, ALL_PROJECTIONS),
        "b": save_adapter(make_hf_model("llama", max_position_embeddings=512), root / "b", 2, ["q_proj", "v_proj"], 4),
    }
    save_adapter(make_hf_model("llama", max_position_embeddings=512), root / "too-big", 3, ["q_proj"], rank=16)
    return root, oracles


@pytest.fixture(scope="module")
def lora_server(checkpoint: Path, adapters) -> Iterator[Server]:
    root, _ = adapters
    engine = Engine(
        dtype="float32",
        model=str(checkpoint),
        num_kv_slots=4096,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[f"a={root / 'a'}"],
    )
    with serve(engine, allowed_weight_roots=(str(root),)) as live:
        yield live


@pytest.fixture(scope="module")
def client(lora_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)


PROMPT = [5, 17, 33, 2, 60, 61, 8, 91, 44, 12]


def expected_text(server: Server, oracle, prompt: list[int], n: int) -> str:
    """The oracle's greedy tokens as text (compared stripped: a continuation's text keeps the
    space before its first word)."""
    return server.engine.tokenizer.decode(hf_greedy(oracle, prompt, n)).strip()


def test_the_model_field_picks_the_adapter(client: openai.OpenAI, lora_server: Server, adapters) -> None:
    _, oracles = adapters
    reply = client.completions.create(
        model="a", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.model == "a"
    assert reply.choices[0].text.strip() == expected_text(lora_server, oracles["a"], PROMPT, 8)
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert base.choices[0].text != reply.choices[0].text  # the adapter changes the output


def test_chat_and_messages_with_an_adapter(client: openai.OpenAI, lora_server: Server, adapters) -> None:
    _, oracles = adapters
    messages = [{"role": "user", "content": "hello world"}]
    prompt = lora_server.engine.tokenizer.apply_chat_template(messages)
    chat = client.chat.completions.create(
        model="a", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.model == "a"
    assert chat.choices[0].message.content.strip() == expected_text(lora_server, oracles["a"], prompt, 6)
    claude = anthropic.Anthropic(base_url=lora_server.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="a", max_tokens=6, messages=messages)
    assert message.model == "a" and message.content  # the same engine path as chat, through Anthropic's shape


def test_models_lists_the_base_and_its_adapters(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "a"]
    assert models[1].model_extra["parent"] == MODEL


def test_unknown_models_are_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert caught.value.code == "model_not_found" and "'a'" in caught.value.message
    with pytest.raises(openai.NotFoundError):  # embeddings serve the base model only
        client.embeddings.create(model="a", input="hello")


def test_adapters_load_and_unload_at_run_time(client: openai.OpenAI, lora_server: Server, adapters) -> None:
    root, oracles = adapters

    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{lora_server.url}/v1/{route}", json=body, timeout=60)

    loaded = post("load_lora_adapter", {"lora_name": "b", "lora_path": str(root / "b")})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'b' added successfully."
    reply = client.completions.create(
        model="b", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text.strip() == expected_text(lora_server, oracles["b"], PROMPT, 8)
    assert [m.id for m in client.models.list().data] == [MODEL, "a", "b"]

    again = post("load_lora_adapter", {"lora_name": "b", "lora_path": str(root / "b")})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    too_big = post("load_lora_adapter", {"lora_name": "c", "lora_path": str(root / "too-big")})
    assert too_big.status_code == 400 and "above max_lora_rank 8" in too_big.json()["error"]["message"]
    outside = post("load_lora_adapter", {"lora_name": "c", "lora_path": str(root.parent)})
    assert outside.status_code == 403

    unloaded = post("unload_lora_adapter", {"lora_name": "b"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'b' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
    missing = post("unload_lora_adapter", {"lora_name": "b"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    metrics = httpx.get(f"{lora_server.url}/metrics").text
    assert "tokenmill_lora_adapters_loaded 1.0" in metrics  # "a" is left
    assert "tokenmill_lora_slot_loads_total" in metrics


def test_adapter_routes_on_a_server_without_lora_refuse(checkpoint: Path, adapters) -> None:
    root, _ = adapters
    with serve(
        Engine(dtype="float32", model=str(checkpoint), num_kv_slots=512), allowed_weight_roots=(str(root),)
    ) as s:
        reply = httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "a")})
        assert reply.status_code == 400 and "enable_lora" in reply.json()["error"]["message"]
