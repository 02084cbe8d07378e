"""A family is its file plus one registry line: the generic config parse knows no architecture
names, and an entry in ``MODELS`` is all the loader needs to build and load a new one."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny_models import save_tiny_model
from tokenmill.model import config as generic_config
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.registry import MODELS, load_model_config


def test_generic_config_names_no_architecture() -> None:
    source = inspect.getsource(generic_config)
    assert not [arch for arch in MODELS if arch in source]


def test_a_registry_line_adds_an_architecture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class NewFamilyForCausalLM(LlamaForCausalLM):
        pass

    save_tiny_model(tmp_path, "llama")
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "architectures": ["NewFamily"]}))
    monkeypatch.setitem(MODELS, "NewFamily", NewFamilyForCausalLM)
    assert load_model_config(tmp_path).architecture == "NewFamily"
    model = load_model(tmp_path, torch.float32, "cpu")
    assert type(model) is NewFamilyForCausalLM
    tensors = load_file(tmp_path / "model.safetensors")
    attn = model.model.layers[1].self_attn
    assert torch.equal(
        attn.qkv_proj.weight[attn.qkv_proj.shard_rows(1)], tensors["model.layers.1.self_attn.k_proj.weight"]
    )
