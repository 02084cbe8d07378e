"""The backend table: every attention backend's name, capabilities and constructor.

``BACKENDS`` lists them in "auto"'s order of preference. Which one an engine gets, and whether a
combination runs at all, is decided from their capabilities in one place,
``model/capabilities.py``; :func:`build_backend` then only constructs the chosen one. Adding a
backend: its module (declaring ``capabilities``, ``plan`` and ``forward``), one entry here, and its
name in ``config.ATTENTION_BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.capabilities import BackendCapabilities
from tokenmill.attention.cpu_backend import CpuBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.attention.triton_capabilities import TRITON_CAPABILITIES
from tokenmill.config import EngineConfig
from tokenmill.kernels.cpu import load_cpu_kernels


@dataclass(frozen=True)
class BackendShape:
    """What a backend is built for: this rank's heads, the head size, the model's softmax scale
    (None: ``head_dim ** -0.5``) and attention logit soft-cap (None: none)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class BackendEntry:
    """One backend: what it supports, whether it can run here, and how to build it."""

    capabilities: BackendCapabilities
    available: Callable[[], bool]
    """Its dependencies are present (checked only for a combination its capabilities accept)."""
    build: Callable[[BackendShape, EngineConfig], AttentionBackend]


def _build_triton(shape: BackendShape, config: EngineConfig) -> AttentionBackend:
    from tokenmill.attention.triton import TritonBackend  # imported on use: TRITON_INTERPRET is read at import
    from tokenmill.attention.triton.config import TritonConfig

    triton_config = TritonConfig(
        prefill_q_tile=config.prefill_q_tile,
        max_decode_splits=config.max_decode_splits,
        decode_split_min_tokens=config.decode_split_min_tokens,
        max_rows=config.max_running_requests,
    )
    device = config.resolved_device()
    return TritonBackend(
        shape.n_heads, shape.n_kv_heads, shape.head_dim, triton_config, device, shape.scale, shape.softcap
    )


def _triton_available() -> bool:
    from tokenmill.attention.triton import TRITON_AVAILABLE

    return TRITON_AVAILABLE


def _build_cpu(shape: BackendShape, config: EngineConfig) -> AttentionBackend:
    return CpuBackend(shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.scale, shape.softcap)


def _build_torch(shape: BackendShape, config: EngineConfig) -> AttentionBackend:
    return TorchNativeBackend(shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.scale, shape.softcap)


BACKENDS: dict[str, BackendEntry] = {
    "triton": BackendEntry(TRITON_CAPABILITIES, _triton_available, _build_triton),
    "cpu": BackendEntry(CpuBackend.capabilities, lambda: load_cpu_kernels() is not None, _build_cpu),
    "torch": BackendEntry(TorchNativeBackend.capabilities, lambda: True, _build_torch),
}


def build_backend(name: str, shape: BackendShape, config: EngineConfig) -> AttentionBackend:
    """The backend ``name`` (a key of :data:`BACKENDS`, already checked) for ``shape``."""
    return BACKENDS[name].build(shape, config)
