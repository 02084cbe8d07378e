"""Shared fixtures: tiny random Hugging Face checkpoints built in-process (never downloaded)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from tests.ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (CI=true: see there)
from tokenmill.default_model import TINY_MODEL_DIR
from tokenmill.model import quantization

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# tests that name no model run on the tiny model (the real default has its own tests: test_default_model.py)
os.environ["TOKENMILL_DEFAULT_MODEL"] = str(TINY_MODEL_DIR)
torch.set_num_threads(min(2, os.cpu_count() or 1))
# GGUF conversions and repacked weights go to a cache of the session's own, never the user's
os.environ["TOKENMILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenmill-test-cache-")
atexit.register(shutil.rmtree, os.environ["TOKENMILL_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def exact_fp32_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 models keep their quantized projections in the rows layout (fp32 activations, as the
    transformers oracle on the dequantized weights has them) also where the int8 path is the AVX2
    one, as on CPUs with AVX512-VNNI; bf16 models still take the panels layout. fp32 in the panels
    layout has its own test against an oracle that quantizes the activations too
    (tests/model/test_quantized_models.py)."""
    rule = quantization.panels_on_cpu
    monkeypatch.setattr(quantization, "panels_on_cpu", lambda dtype: dtype != torch.float32 and rule(dtype))
