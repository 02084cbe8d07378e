"""The checks the parameter classes share: :func:`require` (a :class:`ParameterError` unless a
condition holds), and what counts as an integer and as a number."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.request.errors import ParameterError


def require(ok: bool, param: str, message: str) -> None:
    """Raise ``ParameterError(param, message)`` unless ``ok``."""
    if not ok:
        raise ParameterError(param, message)


def is_int(value: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
