"""``tests/ci_skips.py``: with CI=true, skips for want of triton or a C++ compiler fail; CUDA skips stay skips."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TESTS = """
import shutil
import pytest

@pytest.mark.skipif(True, reason="needs triton")
def test_triton(): pass

@pytest.mark.skipif(shutil.which("no-such-c++") is None, reason="needs a C++ compiler to build the CPU kernels")
def test_compiler(): pass

@pytest.mark.skip(reason="needs CUDA")
def test_cuda(): pass

@pytest.mark.skip(reason="needs triton and a CUDA GPU")
def test_triton_on_gpu(): pass

@pytest.mark.skip(reason="needs Linux madvise(MADV_HUGEPAGE)")
def test_other(): pass

@pytest.mark.xfail(reason="triton interpreter bug", strict=True)
def test_xfail(): assert False

def test_runs(): pass
"""

MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_triton_build", reason="needs triton")

def test_never_collected(): pass
"""


def run(tmp_path: Path, ci: str | None) -> tuple[int, dict[str, str]]:
    """A pytest run of the sample tests with the plugin alone: its exit status, and each test's outcome
    (``failure``/``error``/``skipped``/``passed``; a module skipped or failing at collection is named alone)."""
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(REPO)}
    if ci is not None:
        env["CI"] = ci
    xml = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "--rootdir", "."]
    command += ["--continue-on-collection-errors", f"--junitxml={xml}", "test_sample.py", "test_module_skip.py"]
    status = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120).returncode
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        result[case.get("name") or case.get("classname")] = kinds[0] if kinds else "passed"
    return status, result


STAY_SKIPS = {name: "skipped" for name in ("test_cuda", "test_triton_on_gpu", "test_other", "test_xfail")}


def test_ci_fails_skips_for_dependencies_ci_installs(tmp_path: Path) -> None:
    status, got = run(tmp_path, "true")
    assert status == 1
    # a skip decided at setup (skipif) is a setup error, one decided at collection a collection error
    assert got == {"test_module_skip": "error", "test_triton": "error", "test_compiler": "error"} | STAY_SKIPS | {
        "test_runs": "passed"
    }


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_they_are_skips(tmp_path: Path, ci: str | None) -> None:
    status, got = run(tmp_path, ci)
    assert status == 0
    assert got == {"test_module_skip": "skipped", "test_triton": "skipped", "test_compiler": "skipped"} | STAY_SKIPS | {
        "test_runs": "passed"
    }
