"""Pooling requests (decoder models as embedders, runner "pooling") against transformers' fp32
final hidden states (``model.model(...)``'s last_hidden_state, after the final norm): last and mean
pooling, for llama and qwen3; normalization and Matryoshka ``dimensions``; the same embedding
alone, in a batch, through chunked prefill and after prefix-cache hits; each runner
refusing the other's requests; bad input refused before anything is allocated."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

from tests.embedding_checks import assert_embedding_close
from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, PoolingParams, SamplingParams
from tokenmill.request import ParameterError, RequestOutput

PROMPTS = [
    [5, 17, 33, 2, 60, 61, 8, 91, 44, 12, 12, 70, 3, 29, 50, 6, 77, 41, 19, 88, 23],
    [9, 4, 71, 30],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return path, save_tiny_checkpoint(path, request.param)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    """Chunked prefill: the 21-token prompt runs in three steps of at most 8 tokens."""
    engine = LLM(
        dtype="float32",
        model=str(checkpoint[0]),
        runner="pooling",
        num_kv_slots=512,
        page_size=4,
        max_num_batched_tokens=8,
    )
    yield engine
    engine.shutdown()


def oracle(hf_model, prompt: list[int], pooling: str, dimensions: int | None = None, normalize: bool = True):
    """transformers' embedding: the final-normed hidden states pooled, cut, normalized."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    vector = vector[:dimensions] if dimensions is not None else vector
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_alone_in_a_batch_and_chunked(llm: LLM, checkpoint, pooling: str) -> None:
    params = PoolingParams(pooling=pooling, normalize=False)
    before = llm.engine.stats()["scheduler"]["chunked_prefills"]
    alone = [llm.embed(p, params, use_tqdm=False)[0] for p in PROMPTS]
    assert llm.engine.stats()["scheduler"]["chunked_prefills"] - before >= 2  # the long prompt ran in chunks
    batch = llm.embed(PROMPTS, params, use_tqdm=False)
    for prompt, one, many in zip(PROMPTS, alone, batch):
        assert one.prompt_token_ids == prompt and one.finish_reason == "stop"
        assert_embedding_close(one.outputs.embedding, oracle(checkpoint[1], prompt, pooling, normalize=False))
        assert_embedding_close(many.outputs.embedding, oracle(checkpoint[1], prompt, pooling, normalize=False))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_normalize_and_dimensions(llm: LLM, checkpoint, pooling: str) -> None:
    prompt = PROMPTS[0]
    full = llm.embed([prompt], PoolingParams(pooling=pooling), use_tqdm=False)[0].outputs.embedding
    assert len(full) == 64 and torch.tensor(full).norm() == pytest.approx(1.0, abs=1e-5)
    assert_embedding_close(full, oracle(checkpoint[1], prompt, pooling))
    cut = llm.embed([prompt], PoolingParams(pooling=pooling, dimensions=16), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 16 and torch.tensor(cut).norm() == pytest.approx(1.0, abs=1e-5)  # cut, then normalized
    assert_embedding_close(cut, oracle(checkpoint[1], prompt, pooling, dimensions=16))


def test_last_pooling_after_prefix_cache_hits(llm: LLM, checkpoint) -> None:
    prompt = PROMPTS[2] + PROMPTS[1]
    llm.embed([prompt + [40]], PoolingParams(), use_tqdm=False)  # its full pages go to the prefix cache
    hits = llm.engine.stats()["cache"]["prefix_hit_tokens"]
    for pooling in ("last", "mean"):
        out = llm.embed([prompt], PoolingParams(pooling=pooling), use_tqdm=False)[0]
        assert_embedding_close(out.outputs.embedding, oracle(checkpoint[1], prompt, pooling))
    assert llm.engine.stats()["cache"]["prefix_hit_tokens"] > hits  # "last" reused the cached pages


def test_each_runner_refuses_the_others_requests(llm: LLM, checkpoint) -> None:
    """A pooling engine refuses generation; the same checkpoint under runner "auto" (a plain decoder:
    generate) refuses pooling; neither allocates anything."""
    free = llm.engine.stats()["kv_free_pages"]
    with pytest.raises(ParameterError) as info:
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert info.value.param == "sampling_params" and "runner='generate'" in str(info.value)
    assert llm.engine.stats()["kv_free_pages"] == free
    generating = LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=128)
    try:
        assert generating.engine.runner == "generate"
        with pytest.raises(ParameterError) as info:
            generating.embed([PROMPTS[1]], use_tqdm=False)
        assert info.value.param == "pooling_params" and "runner='pooling'" in str(info.value)
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = generating.generate([PROMPTS[2]], greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(checkpoint[1], PROMPTS[2], 4)
    finally:
        generating.shutdown()


def test_an_aborted_pooling_request_ends_with_abort_and_no_embedding(llm: LLM) -> None:
    engine = llm.engine
    free = engine.stats()["kv_free_pages"]
    deltas: queue.Queue[RequestOutput] = queue.Queue()
    engine.pause_generation()
    try:
        engine.add_request(PROMPTS[0], PoolingParams(), deltas.put, "aborted")
        engine.abort("aborted")
        final = deltas.get(timeout=60)
    finally:
        engine.resume_generation()
    assert final.finished and final.embedding is None and final.outputs[0].finish_reason == "abort"
    assert engine.stats()["kv_free_pages"] == free and engine.stats()["active_requests"] == 0


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_truncate_prompt_tokens_embeds_the_last_tokens(llm: LLM, checkpoint, pooling: str) -> None:
    """A prompt over the context limit (256 tokens here) is refused, unless truncated: then its
    embedding is that of its last k tokens; a prompt shorter than k is embedded whole."""
    long = [(7 * i) % 90 + 4 for i in range(600)]
    with pytest.raises(ParameterError, match="truncate_prompt_tokens shortens it"):
        llm.embed([long], PoolingParams(pooling=pooling), use_tqdm=False)
    (cut,) = llm.embed([long], PoolingParams(pooling=pooling, truncate_prompt_tokens=40), use_tqdm=False)
    assert cut.prompt_token_ids == long[-40:]
    assert_embedding_close(cut.outputs.embedding, oracle(checkpoint[1], long[-40:], pooling))
    (whole,) = llm.embed([PROMPTS[1]], PoolingParams(pooling=pooling, truncate_prompt_tokens=40), use_tqdm=False)
    assert_embedding_close(whole.outputs.embedding, oracle(checkpoint[1], PROMPTS[1], pooling))


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], PoolingParams(), "prompt"),
        ("", PoolingParams(), "prompt"),
        ([1] * 600, PoolingParams(), "prompt"),
        ([1, 2], PoolingParams(pooling="max"), "pooling"),
        ([1, 2], PoolingParams(task="classify"), "task"),
        ([1, 2], PoolingParams(dimensions=0), "dimensions"),
        ([1, 2], PoolingParams(dimensions=65), "dimensions"),
        ([1, 2], PoolingParams(normalize="yes"), "normalize"),
        ([1, 2], PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        ([1, 2], PoolingParams(truncate_prompt_tokens=10**6), "truncate_prompt_tokens"),
    ],
)
def test_bad_input_refused_before_allocation(llm: LLM, prompt, params: PoolingParams, param: str) -> None:
    free = llm.engine.stats()["kv_free_pages"]
    with pytest.raises(ParameterError) as info:
        llm.embed([prompt], params, use_tqdm=False)
    assert info.value.param == param
    assert llm.engine.stats()["kv_free_pages"] == free
