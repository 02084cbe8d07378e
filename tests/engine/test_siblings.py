"""n > 1 siblings: the prompt is computed once and every sibling starts decoding in the same step,
whatever the page size (full pages shared, the partial last page copied), with prefix caching on
or off; outputs equal separate seeded requests and, greedy, transformers."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.intake import SIBLING_SEED_STRIDE
from tokenmill.request import RequestOutput


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model = save_tiny_checkpoint(path, "llama")
    hf_model.generation_config.eos_token_id = None
    return path, hf_model


def stream(llm: LLM, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every delta of one request, in arrival order."""
    deltas: queue.Queue[RequestOutput] = queue.Queue()
    llm.engine.add_request(prompt, params, deltas.put)
    received = [deltas.get(timeout=60)]
    while not received[-1].finished:
        received.append(deltas.get(timeout=60))
    return received


def pages_held_only_by_the_prefix_cache(llm: LLM) -> bool:
    """After every request finished: each page is free, or held once, by the radix tree."""

    def check() -> bool:
        cache = llm.engine.cache
        radix = cache.radix
        tree = {p for node in radix._nodes() for p in node.pages.tolist()} if radix is not None else set()
        counts = cache.allocator.refcount(torch.arange(1, cache.allocator.n_pages)).tolist()
        return all(count == (page in tree) for page, count in enumerate(counts, start=1))

    return llm.engine.call(check)


@pytest.mark.parametrize(
    "page_size, prompt_len, prefix_caching",
    [(16, 5, True), (16, 5, False), (4, 10, True), (4, 8, False)],
)
def test_siblings_start_together_and_compute_the_prompt_once(
    checkpoint, page_size: int, prompt_len: int, prefix_caching: bool
) -> None:
    path, hf_model = checkpoint
    prompt = list(range(11, 11 + prompt_len))
    llm = LLM(
        dtype="float32",
        model=str(path),
        num_kv_slots=512,
        page_size=page_size,
        enable_prefix_caching=prefix_caching,
    )
    try:
        sampling = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
        deltas = stream(llm, prompt, SamplingParams(n=4, seed=5, **sampling))
        computed = llm.engine.stats()["scheduler"]["prompt_tokens_computed"]
        assert pages_held_only_by_the_prefix_cache(llm)
        alone = llm.generate(
            [prompt] * 4,
            [SamplingParams(seed=5 + i * SIBLING_SEED_STRIDE, **sampling) for i in range(4)],
            use_tqdm=False,
        )
        greedy = llm.generate(
            [prompt], SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )[0]
        assert pages_held_only_by_the_prefix_cache(llm)
    finally:
        llm.shutdown()
    assert computed == prompt_len  # the prompt ran once, for sequence 0 only
    first = deltas[0]
    assert sorted(c.index for c in first.outputs) == [0, 1, 2, 3]  # every sibling's first token, one step
    assert all(len(c.token_ids) == 1 for c in first.outputs)
    tokens = {i: [] for i in range(4)}
    for delta in deltas:
        for c in delta.outputs:
            tokens[c.index] += c.token_ids
    assert [tokens[i] for i in range(4)] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(t) for t in tokens.values()}) > 1
    expected = hf_greedy(hf_model, prompt, 6)
    assert [c.token_ids for c in greedy.outputs] == [expected] * 4
