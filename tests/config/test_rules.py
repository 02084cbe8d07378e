"""The rule table (``config/rules.py``): every row refuses its combination, with one error naming
every conflict, when the config is made (rows over settings alone) or when the engine is built
(rows about the checkpoint); the groups partition EngineConfig's flat settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_encoders import save_tiny_encoder
from tokenmill.config import EngineConfig
from tokenmill.config.engine import GROUPS
from tokenmill.config.rules import RULES, Checkpoint, Rule, check_rules, conflicts
from tokenmill.engine.engine import Engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
DRAFT = {"method": "draft_model", "model": "/nowhere", "num_speculative_tokens": 3}
PLAIN = Checkpoint(is_encoder=False, is_gguf=False, is_prequantized=False, device_type="cpu")
ENCODER = dataclasses.replace(PLAIN, is_encoder=True)
GGUF = dataclasses.replace(PLAIN, is_gguf=True)

EXAMPLES: dict[tuple[str, str], tuple[dict[str, Any], Checkpoint | None]] = {
    ("kv_cache_disk_dir", "enable_prefix_caching=False"): (
        dict(kv_cache_disk_dir="/tmp/t", enable_prefix_caching=False),
        None,
    ),
    ("kv_cache_host_bytes", "enable_prefix_caching=False"): (
        dict(kv_cache_host_bytes=1, enable_prefix_caching=False),
        None,
    ),
    ("kv_cache_disk_dir", "tensor_parallel_size > 1"): (dict(kv_cache_disk_dir="/tmp/t", tensor_parallel_size=2), None),
    ("kv_cache_host_bytes", "tensor_parallel_size > 1"): (dict(kv_cache_host_bytes=1, tensor_parallel_size=2), None),
    ("speculative_config (a draft model)", "tensor_parallel_size > 1"): (
        dict(speculative_config=DRAFT, tensor_parallel_size=2),
        None,
    ),
    ("a pre-quantized checkpoint", "quantization"): (
        dict(quantization="int8"),
        dataclasses.replace(PLAIN, is_prequantized=True),
    ),
    ("a GGUF file", "quantization"): (dict(quantization="int4"), GGUF),
    ("a GGUF file", "tensor_parallel_size > 1"): (dict(tensor_parallel_size=2), GGUF),
    ("a GGUF file", "a device other than the CPU"): (dict(), dataclasses.replace(GGUF, device_type="cuda")),
    ("an encoder model", "quantization"): (dict(quantization="int8"), ENCODER),
    ("an encoder model", "tensor_parallel_size > 1"): (dict(tensor_parallel_size=2), ENCODER),
    ("an encoder model", "enable_lora"): (dict(enable_lora=True), ENCODER),
    ("an encoder model", "speculative_config"): (dict(speculative_config=NGRAM), ENCODER),
    ("an encoder model", "kv_cache_disk_dir"): (dict(kv_cache_disk_dir="/tmp/t"), ENCODER),
    ("an encoder model", "kv_cache_host_bytes"): (dict(kv_cache_host_bytes=1), ENCODER),
}
"""One combination per row that breaks it: a new row needs its example here."""


def _config(settings: dict[str, Any]) -> EngineConfig:
    """A config with ``settings`` whose settings-only rows are not checked yet (to check them here)."""
    config = EngineConfig()
    for name, value in settings.items():
        object.__setattr__(config, name, value)
    return config


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: f"{rule.feature} + {rule.other}")
def test_every_row_refuses_its_combination(rule: Rule) -> None:
    assert (rule.feature, rule.other) in EXAMPLES, "a new rule needs an example combination in EXAMPLES"
    settings, checkpoint = EXAMPLES[(rule.feature, rule.other)]
    assert rule.needs_checkpoint == (checkpoint is not None)
    config = _config(settings)
    assert rule in conflicts(config, checkpoint)
    assert rule not in conflicts(EngineConfig(), PLAIN)  # the defaults on a plain checkpoint break no row
    with pytest.raises(ValueError, match="unsupported combination") as refused:
        check_rules(config, checkpoint)
    assert rule.message() in str(refused.value)
    if not rule.needs_checkpoint:  # already refused when the config is made
        with pytest.raises(ValueError, match="unsupported combination"):
            EngineConfig(**settings)


def test_one_error_names_every_conflict() -> None:
    with pytest.raises(ValueError) as refused:
        EngineConfig(kv_cache_disk_dir="/tmp/t", kv_cache_host_bytes=1, enable_prefix_caching=False)
    message = str(refused.value)
    assert message.count("needs enable_prefix_caching") == 2 and "disk tier" in message and "host tier" in message


def test_an_encoder_engine_names_each_refused_setting(tmp_path: Path) -> None:
    """Through a real build: the checkpoint facts come from the folder."""
    save_tiny_encoder(tmp_path / "bert", "bert")
    with pytest.raises(ValueError) as refused:
        Engine(model=str(tmp_path / "bert"), device="cpu", enable_lora=True, speculative_config=NGRAM)
    message = str(refused.value)
    assert "an encoder model with enable_lora" in message and "an encoder model with speculative_config" in message


def test_the_groups_partition_the_flat_settings() -> None:
    config = EngineConfig(page_size=4, max_running_requests=3, cpu_threads=1)
    names = [f.name for group in GROUPS for f in dataclasses.fields(group)]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(EngineConfig))  # each once
    assert len(names) == len(set(names))
    assert config.cache.page_size == 4 and not hasattr(config.cache, "max_running_requests")
    assert config.scheduler.max_running_requests == 3 and config.runtime.cpu_threads == 1
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=3)  # a group's own check
