"""Prompt lookup through TritonBackend (Triton's interpreter on CPU): the greedy tokens of a tiny
llama, and of a tiny mistral whose window is shorter than the prompts, equal plain decoding's on the
same backend, with proposals both accepted and rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs triton")

from tests.tiny_models import save_tiny_checkpoint  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 1000}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [(7 * i) % 40 + 4 for i in range(19)]]


@pytest.mark.parametrize(
    "kind, settings", [("llama", {}), ("mistral", dict(sliding_window=5))], ids=["llama", "mistral"]
)
def test_prompt_lookup_on_triton_gives_plain_decodings_greedy_tokens(tmp_path: Path, kind: str, settings: dict) -> None:
    save_tiny_checkpoint(tmp_path, kind, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs, stats = [], None
    for speculative in (False, True):
        extra = {"speculative_config": NGRAM} if speculative else {}
        llm = LLM(
            dtype="float32",
            model=str(tmp_path),
            attention_backend="triton",
            device="cpu",
            num_kv_slots=256,
            page_size=16,
            cuda_graphs=False,
            **extra,
        )
        try:
            assert llm.engine.model.backend.name == "triton"
            outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
            stats = llm.engine.stats()["speculative"]
        finally:
            llm.shutdown()
    assert outputs[1] == outputs[0]
    assert stats is not None and 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
