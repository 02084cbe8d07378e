"""BackendCapabilities: what an attention backend can run, declared once per backend.

Every backend class declares one (``AttentionBackend.capabilities``); the factory's table lists them
by name and ``model/capabilities.py`` checks a model, device and dtype combination against them when
an engine is built, and picks "auto" from them. A backend also reads its own to defend its contract
per call (a window it cannot apply, a KV dtype it cannot read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.cache.kv_fp8 import is_fp8


@dataclass(frozen=True)
class BackendCapabilities:
    """One backend's row of the capability table."""

    devices: tuple[str, ...] | None
    """Device types it runs on; None: any torch device."""
    dtypes: tuple[torch.dtype, ...]
    """Model (q/k/v) dtypes, and the KV cache dtypes it can read."""
    converts_kv_dtype: bool
    """The KV cache may hold another of ``dtypes`` than the model's: stored and read converted."""
    kv_int8: bool
    """Reads an int8 KV cache (``cache/kv_quant.py``: a scale per token and KV head) in place."""
    kv_fp8: bool
    """Reads an fp8 KV cache (``cache/kv_fp8.py``: e4m3fn or e5m2, scale 1) in place."""
    sliding_window: bool
    """Applies a layer's sliding window."""
    softcap: bool
    """Attention logit soft-capping."""
    cuda_graphs: bool
    """Its decode forward is capturable in a CUDA graph (fixed grid, no host sync, static plan)."""
    cpu_decode_forward: bool
    """The C++ decode forward (``model/decode_forward.py``) computes exactly its decode attention,
    reading the neutral decode view (no plan)."""
    interpreter_devices: tuple[str, ...] = ()
    """Devices it runs on only in a slow test mode (Triton's interpreter): an explicit choice may
    name them, "auto" never picks them."""

    def runs_on(self, device: torch.device, explicit: bool) -> bool:
        """Whether it runs on ``device`` (``explicit``: the user named this backend)."""
        if self.devices is None or device.type in self.devices:
            return True
        return explicit and device.type in self.interpreter_devices

    def reads_kv(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether it runs a ``dtype`` model over a ``kv_dtype`` KV cache."""
        if kv_dtype == torch.int8:
            return self.kv_int8
        if is_fp8(kv_dtype):
            return self.kv_fp8
        return kv_dtype in self.dtypes and (kv_dtype == dtype or self.converts_kv_dtype)
