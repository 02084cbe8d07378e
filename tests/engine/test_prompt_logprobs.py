"""prompt_logprobs against transformers' fp32 log-softmax over the prompt: one entry per prompt
token (the first None), the actual token plus the top k, through chunked prefill, after a
prefix-cached request, with n > 1, delivered with the first delta."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.request import Logprob, RequestOutput

PROMPT = [5, 17, 33, 2, 60, 61, 8, 91, 44, 12, 12, 70, 3, 29, 50, 6, 77, 41, 19, 88, 23]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny_checkpoint(path, "llama")


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    """Chunked prefill: a 21-token prompt runs in three steps of at most 8 tokens."""
    engine = LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=512, page_size=4, max_num_batched_tokens=8)
    yield engine
    engine.shutdown()


def oracle(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax at every prompt position: row p predicts token p + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(entries: list[dict[int, Logprob] | None], expected: torch.Tensor, prompt: list[int], k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, token = expected[p], prompt[p + 1]
        assert next(iter(entry)) == token  # the actual prompt token first
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(entry) == {token, *top}
        for t in top:
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert entry[t].rank == top.index(t) + 1


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers_through_chunked_prefill(llm: LLM, checkpoint, k: int) -> None:
    before = llm.engine.stats()["scheduler"]["chunked_prefills"]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=k), use_tqdm=False)[0]
    assert llm.engine.stats()["scheduler"]["chunked_prefills"] - before >= 2
    assert_matches(out.prompt_logprobs, oracle(checkpoint[1], PROMPT), PROMPT, k)


def test_prompt_logprobs_after_a_prefix_cached_request(llm: LLM, checkpoint) -> None:
    prompt = PROMPT[::-1]
    warm = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert warm.prompt_logprobs is None and again.num_cached_tokens > 0  # the prompt's pages are cached
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # asking prompt_logprobs computes the whole prompt
    assert_matches(out.prompt_logprobs, oracle(checkpoint[1], prompt), prompt, 2)


def test_prompt_logprobs_with_n_siblings_arrive_once_with_the_first_delta(llm: LLM, checkpoint) -> None:
    prompt = PROMPT[3:14]
    before = llm.engine.stats()["scheduler"]["prompt_tokens_computed"]
    deltas: queue.Queue[RequestOutput] = queue.Queue()
    llm.engine.add_request(prompt, SamplingParams(n=3, max_tokens=3, prompt_logprobs=1, seed=1), deltas.put)
    received = [deltas.get(timeout=60)]
    while not received[-1].finished:
        received.append(deltas.get(timeout=60))
    assert llm.engine.stats()["scheduler"]["prompt_tokens_computed"] - before == len(prompt)
    assert received[0].outputs  # the first delta carries tokens and the prompt's logprobs
    assert_matches(received[0].prompt_logprobs, oracle(checkpoint[1], prompt), prompt, 1)
    assert all(d.prompt_logprobs is None for d in received[1:])


def test_a_one_token_prompt_has_one_none_entry(llm: LLM) -> None:
    out = llm.generate([[7]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
