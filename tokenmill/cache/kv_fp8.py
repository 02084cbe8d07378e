"""The fp8 KV cache's format (``kv_cache_dtype`` "fp8_e4m3", "fp8_e5m2"; "fp8" is e4m3, as in vLLM).

Keys and values are stored as ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, one byte a value,
with one fp32 scale per layer for the keys and one for the values, fixed at ``FP8_SCALE`` = 1 (vLLM's
default without calibrated scales): a stored value is the fp8 value itself, so the buffers need
nothing beside them. Storing clamps to the format's largest finite magnitude (448 for e4m3, 57344 for
e5m2; a NaN stays NaN) and rounds to nearest even (torch's conversion), so out-of-range values
saturate, never becoming inf; reading widens exactly (every fp8 value is a bf16 and an fp32 value).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_SCALE = 1.0
"""The per-layer key and value scale: fixed, so the kernels read the fp8 values as they are."""


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as ``dtype`` (an fp8 dtype): clamped to its largest finite magnitude, then rounded to nearest."""
    limit = torch.finfo(dtype).max
    return x.float().clamp(-limit, limit).to(dtype)
