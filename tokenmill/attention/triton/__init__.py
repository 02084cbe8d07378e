"""Triton attention backend (optional: needs the ``triton`` package).

Importing this package never fails: without triton, ``TRITON_AVAILABLE`` is False and
``TritonBackend`` raises ImportError when constructed. Nothing else in tokenmill imports this
package at import time, so ``TRITON_INTERPRET`` (read by triton when the kernels are defined,
i.e. when this package is first imported) can be set at any time before that first import.
"""

from __future__ import annotations

from typing import Any

try:
    import triton  # noqa: F401
except ImportError as exc:
    _TRITON_ERROR: ImportError | None = exc
else:
    _TRITON_ERROR = None

TRITON_AVAILABLE = _TRITON_ERROR is None

if TRITON_AVAILABLE:
    from tokenmill.attention.triton.backend import TritonBackend
else:

    class TritonBackend:  # type: ignore[no-redef]
        """Placeholder when triton is missing: constructing it raises a clear ImportError."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                "attention_backend='triton' needs the triton package (pip install triton); "
                f"importing it failed: {_TRITON_ERROR}"
            )


__all__ = ["TRITON_AVAILABLE", "TritonBackend"]
