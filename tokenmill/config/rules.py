"""The rule table: every "X with Y is not supported" of the engine, one row each.

A row names the two things that conflict and says why; :func:`check_rules` walks the table and
raises one ValueError naming every conflict of a configuration. Rows over settings alone are checked
when an :class:`~tokenmill.config.EngineConfig` is made (a bad command line fails at once); rows that
also need facts about the checkpoint (:class:`Checkpoint`, known once the engine's builder has read
its config) are checked when the engine is built. A new refusal is a new row here. What a backend or
a model family can run (dtypes, devices, sliding windows, ...) is the capability table's, in
``model/capabilities.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tokenmill.speculative_config import SpeculativeConfig


class EngineConfig(Protocol):
    """The settings the rules read (:class:`tokenmill.config.EngineConfig` has them all)."""

    tensor_parallel_size: int
    quantization: str | None
    enable_prefix_caching: bool
    kv_cache_disk_dir: str | None
    kv_cache_host_bytes: int
    enable_lora: bool

    def speculative(self) -> SpeculativeConfig | None: ...


@dataclass(frozen=True)
class Checkpoint:
    """What the rules need to know of the checkpoint and the device (the builder fills it in)."""

    is_encoder: bool
    is_gguf: bool
    is_prequantized: bool
    device_type: str


@dataclass(frozen=True)
class Rule:
    """``when`` holds for a configuration that combines ``feature`` with ``other``: refused, ``why``."""

    feature: str
    other: str
    why: str
    when: Callable[[EngineConfig, Checkpoint | None], bool]
    needs_checkpoint: bool = False

    def message(self) -> str:
        return f"{self.feature} with {self.other}: {self.why}"


def _tp(cfg: EngineConfig) -> bool:
    return cfg.tensor_parallel_size > 1


def _draft(cfg: EngineConfig) -> bool:
    speculative = cfg.speculative()
    return speculative is not None and speculative.model is not None


def _encoder_without(name: str, on: Callable[[EngineConfig], bool]) -> Rule:
    return Rule(
        "an encoder model",
        name,
        "an encoder runs alone: one rank, full precision, no KV cache to share or extend",
        lambda cfg, ckpt: ckpt is not None and ckpt.is_encoder and on(cfg),
        needs_checkpoint=True,
    )


def _gguf_without(name: str, on: Callable[[EngineConfig, Checkpoint], bool]) -> Rule:
    return Rule(
        "a GGUF file",
        name,
        "a GGUF file loads as stored (quantization unset), on the CPU, without tensor parallelism",
        lambda cfg, ckpt: ckpt is not None and ckpt.is_gguf and on(cfg, ckpt),
        needs_checkpoint=True,
    )


RULES: tuple[Rule, ...] = (
    Rule(
        "kv_cache_disk_dir",
        "enable_prefix_caching=False",
        "needs enable_prefix_caching (the disk tier holds cached prefixes)",
        lambda cfg, _: cfg.kv_cache_disk_dir is not None and not cfg.enable_prefix_caching,
    ),
    Rule(
        "kv_cache_host_bytes",
        "enable_prefix_caching=False",
        "needs enable_prefix_caching (the host tier holds cached prefixes)",
        lambda cfg, _: cfg.kv_cache_host_bytes > 0 and not cfg.enable_prefix_caching,
    ),
    Rule(
        "kv_cache_disk_dir",
        "tensor_parallel_size > 1",
        "the disk tier is not supported with tensor parallelism yet",
        lambda cfg, _: cfg.kv_cache_disk_dir is not None and _tp(cfg),
    ),
    Rule(
        "kv_cache_host_bytes",
        "tensor_parallel_size > 1",
        "the host tier is not supported with tensor parallelism yet",
        lambda cfg, _: cfg.kv_cache_host_bytes > 0 and _tp(cfg),
    ),
    Rule(
        "speculative_config (a draft model)",
        "tensor_parallel_size > 1",
        "a draft model runs on one rank: not supported with tensor parallelism",
        lambda cfg, _: _draft(cfg) and _tp(cfg),
    ),
    Rule(
        "a pre-quantized checkpoint",
        "quantization",
        "it loads quantized as published (quantization_config in config.json); leave quantization unset",
        lambda cfg, ckpt: ckpt is not None and ckpt.is_prequantized and cfg.quantization is not None,
        needs_checkpoint=True,
    ),
    _gguf_without("quantization", lambda cfg, _: cfg.quantization is not None),
    _gguf_without("tensor_parallel_size > 1", lambda cfg, _: _tp(cfg)),
    _gguf_without("a device other than the CPU", lambda _, ckpt: ckpt.device_type != "cpu"),
    _encoder_without("quantization", lambda cfg: cfg.quantization is not None),
    _encoder_without("tensor_parallel_size > 1", _tp),
    _encoder_without("enable_lora", lambda cfg: cfg.enable_lora),
    _encoder_without("speculative_config", lambda cfg: cfg.speculative() is not None),
    _encoder_without("kv_cache_disk_dir", lambda cfg: cfg.kv_cache_disk_dir is not None),
    _encoder_without("kv_cache_host_bytes", lambda cfg: cfg.kv_cache_host_bytes > 0),
)


def conflicts(config: EngineConfig, checkpoint: Checkpoint | None = None) -> list[Rule]:
    """The rows ``config`` breaks (with ``checkpoint`` None: only the rows over settings alone)."""
    return [
        rule
        for rule in RULES
        if (checkpoint is not None or not rule.needs_checkpoint) and rule.when(config, checkpoint)
    ]


def check_rules(config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
    """Raise one ValueError naming every conflict of ``config`` (see :func:`conflicts`)."""
    broken = conflicts(config, checkpoint)
    if broken:
        raise ValueError("unsupported combination: " + "; ".join(rule.message() for rule in broken))
