"""make_backend: the attention backend for an engine, from ``EngineConfig.attention_backend``.

"auto": triton on CUDA when installed; for fp32 or bf16 on CPU "cpu" (C++ kernels) when they build;
else the torch reference; for a model with sliding-window layers, only a backend that applies the
window (``supports_sliding_window``), and for one with attention logit soft-capping only one that
implements it (``supports_softcap``). An explicit choice is strict: it raises instead of falling back.
The model's softmax ``scale`` and ``softcap`` are passed to the backend (``CausalLM.backend`` checks them).
Adding a backend: its module, one entry in ``_BACKENDS`` (and the name in ``config.ATTENTION_BACKENDS``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.config import EngineConfig
from tokenmill.kernels.cpu import load_cpu_kernels

Scores = tuple[float | None, float | None]
"""The model's softmax scale (None: ``head_dim ** -0.5``) and attention logit soft-cap (None: none)."""


def _triton(
    n_heads: int, n_kv_heads: int, head_dim: int, config: EngineConfig, dtype: torch.dtype, scores: Scores
) -> AttentionBackend:
    from tokenmill.attention.triton import TritonBackend  # imported on use: TRITON_INTERPRET is read at import

    if config.resolved_kv_dtype(dtype) != dtype:
        raise ValueError(f"attention_backend='triton' needs kv_cache_dtype 'auto' (the model's {dtype})")
    return TritonBackend(n_heads, n_kv_heads, head_dim, config, *scores)


def _cpu(
    n_heads: int, n_kv_heads: int, head_dim: int, config: EngineConfig, dtype: torch.dtype, scores: Scores
) -> AttentionBackend:
    from tokenmill.attention.cpu_backend import SUPPORTED_DTYPES, CpuBackend

    device = config.resolved_device()
    kv_dtype = config.resolved_kv_dtype(dtype)
    if device.type != "cpu" or dtype not in SUPPORTED_DTYPES or kv_dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"attention_backend='cpu' needs fp32 or bf16 on CPU, got a {dtype} model and {kv_dtype} KV on {device}"
        )
    return CpuBackend(n_heads, n_kv_heads, head_dim, *scores)


def _torch(
    n_heads: int, n_kv_heads: int, head_dim: int, config: EngineConfig, dtype: torch.dtype, scores: Scores
) -> AttentionBackend:
    return TorchNativeBackend(n_heads, n_kv_heads, head_dim, *scores)


_BACKENDS: dict[str, Callable[[int, int, int, EngineConfig, torch.dtype, Scores], AttentionBackend]] = {
    "triton": _triton,
    "cpu": _cpu,
    "torch": _torch,
}


def auto_backend_name(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, sliding_window: bool = False, softcap: bool = False
) -> str:
    """What "auto" resolves to on ``device`` for a ``dtype`` model with a ``kv_dtype`` cache
    (``sliding_window``: with sliding-window layers; ``softcap``: with attention logit soft-capping)."""
    if device.type == "cuda":
        from tokenmill.attention.triton import TRITON_AVAILABLE, TritonBackend

        windows_ok = not sliding_window or TritonBackend.supports_sliding_window
        softcap_ok = not softcap or TritonBackend.supports_softcap
        return "triton" if TRITON_AVAILABLE and kv_dtype == dtype and windows_ok and softcap_ok else "torch"
    supported = (torch.float32, torch.bfloat16)
    if device.type == "cpu" and dtype in supported and kv_dtype in supported:
        from tokenmill.attention.cpu_backend import CpuBackend

        softcap_ok = not softcap or CpuBackend.supports_softcap
        return "cpu" if load_cpu_kernels() is not None and softcap_ok else "torch"
    return "torch"


def make_backend(
    config: EngineConfig,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> AttentionBackend:
    """The backend ``config.attention_backend`` names (resolving "auto") for a model of that shape;
    ``sliding_window``: the model has sliding-window layers, which a backend that cannot apply the
    window refuses (ValueError) rather than attend to the whole context; ``scale``: the softmax
    scale (None: ``head_dim ** -0.5``); ``softcap``: attention logit soft-capping, which a backend
    that does not implement it refuses (ValueError)."""
    name = config.attention_backend
    if name == "auto":
        device, kv_dtype = config.resolved_device(), config.resolved_kv_dtype(dtype)
        name = auto_backend_name(device, dtype, kv_dtype, sliding_window, softcap is not None)
    backend = _BACKENDS[name](n_heads, n_kv_heads, head_dim, config, dtype, (scale, softcap))
    if sliding_window and not backend.supports_sliding_window:
        raise ValueError(
            f"attention_backend={name!r} does not implement sliding-window attention, which this model uses; "
            "use attention_backend='torch' (or 'cpu' on CPU)"
        )
    return backend
