"""A server over a quantized engine (quantized at load, or a pre-quantized checkpoint): ``/v1/models``
says so, and a completion through the official client returns what the engine generates."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoModelForCausalLM

from tests.model.test_prequantized_checkpoints import CASES, quantize_checkpoint
from tests.server.conftest import MODEL, Server, engine_generate, serve
from tokenmill.engine.engine import Engine
from tokenmill.request import SamplingParams


@pytest.fixture(scope="module")
def quantized(checkpoint: Path) -> Iterator[Server]:
    with serve(Engine(dtype="float32", model=str(checkpoint), num_kv_slots=1024, quantization="int4")) as live:
        yield live


@pytest.fixture(scope="module")
def awq(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("awq") / MODEL
    shutil.copytree(checkpoint, path)
    quantizer, config = CASES["awq_g32"]
    quantize_checkpoint(path, AutoModelForCausalLM.from_pretrained(path), quantizer, config)
    with serve(Engine(dtype="float32", model=str(path), num_kv_slots=1024)) as live:
        yield live


@pytest.mark.parametrize(("live", "quantization"), [("quantized", "int4"), ("awq", "awq")])
def test_models_list_shows_the_quantization_and_completions_match_the_engine(
    live: str, quantization: str, request: pytest.FixtureRequest
) -> None:
    server: Server = request.getfixturevalue(live)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["quantization"] == quantization
    truth = engine_generate(server.engine, [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    reply = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert truth.outputs[0].text and reply.choices[0].text == truth.outputs[0].text
