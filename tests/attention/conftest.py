"""Attention tests run the Triton kernels on CPU through Triton's interpreter.

Triton picks interpreter or compiler when a kernel is defined, i.e. when
``tokenmill.attention.triton`` is first imported. Nothing else in tokenmill imports that package,
and pytest loads this conftest while collecting, before any test runs, so setting the variable
here is early enough even when other test modules imported tokenmill (or triton) first.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
