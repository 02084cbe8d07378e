"""The attention factory: every configurable backend name has a constructor, and "auto" resolves."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention import factory
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.config import ATTENTION_BACKENDS, EngineConfig


def test_every_configurable_name_has_a_backend() -> None:
    assert set(factory._BACKENDS) == set(ATTENTION_BACKENDS)


def test_explicit_choices_are_strict() -> None:
    with pytest.raises(ValueError, match="needs fp32 or bf16 on CPU"):
        factory.make_backend(EngineConfig(attention_backend="cpu", device="cpu"), 4, 2, 8, torch.float16)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_auto_is_the_reference_for_fp16_on_cpu() -> None:
    backend = factory.make_backend(EngineConfig(device="cpu"), 4, 2, 8, torch.float16)
    assert type(backend) is TorchNativeBackend
    assert factory.auto_backend_name(torch.device("cpu"), torch.float16, torch.float16) == "torch"
    assert factory.auto_backend_name(torch.device("cpu"), torch.bfloat16, torch.float16) == "torch"


def test_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="needs fp32 or bf16"):
        factory.make_backend(
            EngineConfig(attention_backend="cpu", device="cpu", kv_cache_dtype="float16"), 4, 2, 8, torch.float32
        )


def test_sliding_window_models_get_a_backend_that_applies_the_window() -> None:
    pytest.importorskip("triton")
    cpu = EngineConfig(device="cpu")
    assert factory.make_backend(cpu, 4, 2, 8, torch.float32, sliding_window=True).supports_sliding_window
    assert factory.make_backend(cpu, 4, 2, 8, torch.float16, sliding_window=True).supports_sliding_window
    # the triton kernels apply the window: "auto" keeps them on CUDA, an explicit choice is honoured
    assert factory.auto_backend_name(torch.device("cuda"), torch.float16, torch.float16, True) == "triton"
    triton = factory.make_backend(
        EngineConfig(attention_backend="triton", device="cpu"), 4, 2, 8, torch.float32, sliding_window=True
    )
    assert triton.name == "triton" and triton.supports_sliding_window
    # soft-capping stays refused by triton: "auto" passes it over on CUDA
    assert factory.auto_backend_name(torch.device("cuda"), torch.float16, torch.float16, True, True) == "torch"
