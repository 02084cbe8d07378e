"""``tokenmill bench decode``: fresh processes, their spread, and the bytes a decode step reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM
from tokenmill.bench.decode import decode_bytes
from tokenmill.default_model import TINY_MODEL_DIR


def test_the_command_reports_each_fresh_start_and_the_roof_fraction_of_its_bytes() -> None:
    command = [sys.executable, "-m", "tokenmill.cli", "bench", "decode", "--model", str(TINY_MODEL_DIR)]
    command += ["--starts", "2", "--context", "16", "--tokens", "4", "--repeats", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    starts = result["decode_ms_per_token"]["starts"]
    assert len(starts) == 2 and len(result["ready_s"]) == 2  # (no timing asserted: tiny shapes, any machine)
    assert result["decode_ms_per_token"]["spread"] == pytest.approx(max(starts) / min(starts))
    median = result["decode_ms_per_token"]["median"]
    expected = result["decode_bytes"] / (median / 1000) / (result["read_gbps"] * 1e9)
    assert result["roof_fraction"] == pytest.approx(expected)
    llm = LLM(model=str(TINY_MODEL_DIR), skip_tokenizer_init=True)
    try:
        assert result["decode_bytes"] == decode_bytes(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tied", [True, False])
def test_a_step_reads_every_weight_but_an_embedding_table_that_is_only_indexed(tied: bool, tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path, tie_word_embeddings=tied)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32")
    try:
        model = llm.engine.worker.model
        table = model.model.embed_tokens.weight.numel() * 4
        everything = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert decode_bytes(llm) == (everything if tied else everything - table)
    finally:
        llm.shutdown()
