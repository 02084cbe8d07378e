"""The Triton backend's capabilities, beside its package: reading them never imports triton (the
package defines its kernels on import, see ``attention/triton/__init__.py``)."""

from __future__ import annotations

import torch

from tokenmill.attention.capabilities import BackendCapabilities

TRITON_CAPABILITIES = BackendCapabilities(
    devices=("cuda",),
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    converts_kv_dtype=False,
    kv_int8=True,
    kv_fp8=True,
    sliding_window=True,
    softcap=False,
    cuda_graphs=True,
    cpu_decode_forward=False,
    interpreter_devices=("cpu",),
)
