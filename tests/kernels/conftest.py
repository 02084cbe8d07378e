"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

Triton picks interpreter or compiler when a kernel is defined, i.e. when
``tokenmill.kernels.lora_triton`` is first imported; nothing imports it before a test does, and
pytest loads this conftest while collecting, so setting the variable here is early enough.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
