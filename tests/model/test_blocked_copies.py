"""Blocked weight copies are made at start-up, not by the first requests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.linear import BLOCKED_MIN_ROWS, Linear
from tokenmill.model.moe import Experts

DTYPES = [dtype for dtype in (torch.bfloat16, torch.float32) if dtype in BLOCKED_MIN_ROWS]


@pytest.mark.skipif(
    not DTYPES, reason="this CPU's products use no blocked copies (oneDNN's layout pays only with AVX-512)"
)
def test_every_blocked_copy_exists_before_the_first_request_and_the_requests_make_none(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    dtype = str(DTYPES[0]).removeprefix("torch.")
    llm = LLM(model=str(tmp_path), dtype=dtype)
    try:
        model = llm.engine.worker.model
        copies = [m._blocked for m in model.modules() if isinstance(m, Linear)]
        copies += [copy for m in model.modules() if isinstance(m, Experts) for pair in m._blocked for copy in pair]
        made = [copy._made[1] if copy._made is not None else None for copy in copies]
        assert len(copies) > 4 and all(copy is not None for copy in made)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate([list(range(3, 30)), [5, 6, 7]], params, use_tqdm=False)
        assert all(copy._made is not None and copy._made[1] is before for copy, before in zip(copies, made))
    finally:
        llm.shutdown()
