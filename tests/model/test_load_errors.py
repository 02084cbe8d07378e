"""Bad checkpoints fail with an error that names the file or tensor and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import save_tiny_model
from tokenmill.model.config import ModelConfigError
from tokenmill.model.loader import WeightError, load_model
from tokenmill.model.registry import MODELS, load_model_config


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_tiny_model(tmp_path, "llama")
    return tmp_path


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture(checkpoint: Path) -> None:
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match=r"config.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_model(checkpoint, torch.float32, "cpu")


def test_unsupported_rope_type(checkpoint: Path) -> None:
    _edit_config(checkpoint, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(ModelConfigError, match="unsupported rope type 'longrope'"):
        load_model(checkpoint, torch.float32, "cpu")


def test_corrupt_config(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    with pytest.raises(ModelConfigError, match="config.json is not valid JSON"):
        load_model(checkpoint, torch.float32, "cpu")


def test_config_missing_field(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    del config["intermediate_size"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="missing required field 'intermediate_size'"):
        load_model(checkpoint, torch.float32, "cpu")


def test_missing_config_and_weights(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "nowhere", torch.float32, "cpu")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(checkpoint, torch.float32, "cpu")


def test_missing_weight(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(WeightError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_model(checkpoint, torch.float32, "cpu")


def test_wrong_shape(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(
        WeightError,
        match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(3, 64\), "
        r"expected \(32, 64\)",
    ):
        load_model(checkpoint, torch.float32, "cpu")


def test_unexpected_tensor(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.rogue.weight"] = torch.zeros(2)
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(WeightError, match="unexpected tensor 'model.layers.0.self_attn.rogue.weight'"):
        load_model(checkpoint, torch.float32, "cpu")


def test_unsupported_architecture_names_the_supported_ones(checkpoint: Path) -> None:
    _edit_config(checkpoint, architectures=[])
    supported = ", ".join(MODELS)
    with pytest.raises(ModelConfigError, match=f"unsupported architecture None; supported: {supported}$"):
        load_model_config(checkpoint)


def test_sliding_window_limits_context(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "mistral", sliding_window=64)
    assert load_model_config(tmp_path).max_context_len == 64


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_sliding_window_counts_only_when_used(tmp_path: Path, kind: str) -> None:
    save_tiny_model(tmp_path, kind)
    _edit_config(tmp_path, sliding_window=64, use_sliding_window=False)
    assert load_model_config(tmp_path).sliding_window is None
    _edit_config(tmp_path, use_sliding_window=True)
    assert load_model_config(tmp_path).max_context_len == 64
