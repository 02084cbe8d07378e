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
    _edit_config(checkpoint, rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(ModelConfigError, match="unsupported rope type 'mrope'"):
        load_model(checkpoint, torch.float32, "cpu")


def test_freq_factors_are_positive_numbers_one_per_rotated_frequency(checkpoint: Path) -> None:
    for factors, message in (
        ("8", "'freq_factors' must be a list of positive numbers"),
        ([1.0, 0.0] * 4, "'freq_factors' must be a list of positive numbers"),
        ([1.0] * 7, r"rope 'freq_factors' has 7 entries, expected 8 \(rotary dims / 2\)"),
    ):
        _edit_config(checkpoint, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "freq_factors": factors})
        with pytest.raises(ModelConfigError, match=message):
            load_model_config(checkpoint)
    _edit_config(checkpoint, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "freq_factors": [1.0] * 8})
    with pytest.raises(ModelConfigError, match="'freq_factors' with rope type 'dynamic' is not supported"):
        load_model_config(checkpoint)


def test_longrope_needs_a_factor_per_rotated_frequency(checkpoint: Path) -> None:
    _edit_config(checkpoint, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(ModelConfigError, match="rope type 'longrope' needs 'short_factor'"):
        load_model_config(checkpoint)
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 7}
    _edit_config(checkpoint, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, **factors})
    with pytest.raises(ModelConfigError, match=r"rope 'long_factor' has 7 entries, expected 8 \(rotary dims / 2\)"):
        load_model_config(checkpoint)


def test_partial_rotary_only_where_the_family_supports_it(checkpoint: Path) -> None:
    _edit_config(checkpoint, partial_rotary_factor=0.5)
    with pytest.raises(ModelConfigError, match="partial_rotary_factor != 1 is not supported for LlamaForCausalLM"):
        load_model(checkpoint, torch.float32, "cpu")
    _edit_config(checkpoint, architectures=["Phi3ForCausalLM"])
    assert load_model_config(checkpoint).rotary_dim == 8
    _edit_config(checkpoint, partial_rotary_factor=0.1)
    with pytest.raises(ModelConfigError, match="partial_rotary_factor 0.1 gives 1 rotary dims of head_dim 16"):
        load_model_config(checkpoint)


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


def test_sliding_window_slides_every_layer_and_keeps_the_context(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "mistral", sliding_window=64)
    config = load_model_config(tmp_path)
    assert config.max_context_len == config.max_position_embeddings == 256
    assert [config.layer_sliding_window(i) for i in range(config.num_layers)] == [64, 64]
    _edit_config(tmp_path, sliding_window=0)
    with pytest.raises(ModelConfigError, match="'sliding_window' must be a positive integer or null, got 0"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_sliding_window_counts_only_when_used_in_its_layers(tmp_path: Path, kind: str) -> None:
    """transformers 5: config.json's layer_types when present, else the layers from max_window_layers on."""
    save_tiny_model(tmp_path, kind, num_hidden_layers=3)

    def windows() -> list[int | None]:
        config = load_model_config(tmp_path)
        assert config.max_context_len == 256
        return [config.layer_sliding_window(i) for i in range(config.num_layers)]

    _edit_config(tmp_path, sliding_window=64, use_sliding_window=False, layer_types=None, max_window_layers=1)
    assert load_model_config(tmp_path).sliding_window is None and windows() == [None] * 3
    _edit_config(tmp_path, use_sliding_window=True)
    assert windows() == [None, 64, 64]
    _edit_config(tmp_path, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert windows() == [64, None, 64]
    _edit_config(tmp_path, layer_types=["sliding_attention"])
    with pytest.raises(ModelConfigError, match="'layer_types' must list one type per layer"):
        load_model_config(tmp_path)
