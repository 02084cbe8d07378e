"""In CI, a skip for want of something ``.ci/run`` installs is a failure, not a skip.

``.ci/run`` installs the ``triton`` extra (triton) and the tests need the system's C++ compiler
(with the ``ninja`` package) for the CPU kernels. Locally, without them, those tests skip; in CI
(``CI=true``), a broken or missing triton or compiler would otherwise skip every Triton or C++
kernel test silently and the run would pass, so such a skip (a test's, or a module's at
collection, e.g. ``pytest.importorskip("triton")``) is reported as a failure naming the reason.
Skips for hardware CI does not have (CUDA, a GPU, a CPU feature) stay skips.

A pytest plugin: ``tests/conftest.py`` imports its hooks (``-p tests.ci_skips`` loads it alone).
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator
from typing import Any

import pytest

CI_DEPENDENCY = re.compile(r"\btriton\b|C\+\+ compiler|\bninja\b", re.IGNORECASE)
"""Skip reasons naming a dependency ``.ci/run`` installs."""

HARDWARE = re.compile(r"\bCUDA\b|\bGPUs?\b", re.IGNORECASE)
"""Skip reasons naming hardware CI does not have: these stay skips even when they also name triton."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def needs_ci_dependency(reason: str) -> bool:
    """True when a skip for ``reason`` means something ``.ci/run`` installs is missing or broken."""
    return bool(CI_DEPENDENCY.search(reason)) and not HARDWARE.search(reason)


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    if not report.skipped or hasattr(report, "wasxfail"):  # xfail reports as skipped too: not a skip
        return None
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = _skip_reason(report)
    if reason is not None and in_ci() and needs_ci_dependency(reason):
        report.outcome = "failed"
        report.longrepr = f"{reason}\nskipped in CI (CI=true), where .ci/run installs this dependency: a failure"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    _fail_in_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    _fail_in_ci(report)
    return report
