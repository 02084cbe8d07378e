"""The backend table: every configurable backend name has an entry, and each builds its backend."""

from __future__ import annotations

import torch

from tokenmill.attention import factory
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.config import ATTENTION_BACKENDS, EngineConfig


def test_every_configurable_name_has_a_backend() -> None:
    assert set(factory.BACKENDS) == set(ATTENTION_BACKENDS)


def test_builds_the_named_backend_for_the_shape() -> None:
    backend = factory.build_backend("torch", factory.BackendShape(4, 2, 8, scale=0.5), EngineConfig(device="cpu"))
    assert type(backend) is TorchNativeBackend
    assert (backend.n_heads, backend.n_kv_heads, backend.head_dim, backend.scale) == (4, 2, 8, 0.5)


def test_each_backend_declares_the_capabilities_it_is_listed_with() -> None:
    from tokenmill.attention.cpu_backend import CpuBackend

    assert factory.BACKENDS["torch"].capabilities is TorchNativeBackend.capabilities
    assert factory.BACKENDS["cpu"].capabilities is CpuBackend.capabilities
    assert factory.BACKENDS["triton"].capabilities.dtypes == (torch.float32, torch.float16, torch.bfloat16)
