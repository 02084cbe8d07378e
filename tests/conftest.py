"""Shared fixtures: tiny random Hugging Face checkpoints built in-process (never downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (CI=true: see there)
from tokenmill.default_model import TINY_MODEL_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# tests that name no model run on the tiny model (the real default has its own tests: test_default_model.py)
os.environ["TOKENMILL_DEFAULT_MODEL"] = str(TINY_MODEL_DIR)
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
