"""The dtypes settings may name: the model's and the KV cache's."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
KV_DTYPES: dict[str, torch.dtype] = {
    **DTYPES,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""KV cache dtypes: the model dtypes, int8 (symmetric, one fp32 scale per token and KV head) and fp8
(e4m3fn or e5m2, one fixed scale 1 per layer: ``cache/kv_fp8.py``; "fp8" is e4m3, as in vLLM)."""


def check_dtype_name(name: str, value: str, table: dict[str, torch.dtype]) -> None:
    """Raise ValueError unless ``value`` is "auto" or a key of ``table``."""
    if value != "auto" and value not in table:
        raise ValueError(f"{name} must be 'auto' or one of {sorted(table)}, got {value!r}")
