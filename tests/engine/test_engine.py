"""The engine end to end on a tiny random llama: batching, preemption, chunked prefill, stops,
sampling parameters through the real loop, intake errors, abort, streaming."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest

from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, AsyncEngine, SamplingParams
from tokenmill.engine.intake import SIBLING_SEED_STRIDE
from tokenmill.request import ParameterError, RequestOutput

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model = save_tiny_checkpoint(path, "llama", max_position_embeddings=512)
    hf_model.generation_config.eos_token_id = None
    return path, hf_model


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    engine = LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=2048, max_num_batched_tokens=128)
    yield engine
    engine.shutdown()


def test_batch_with_preemption_and_chunking_equals_alone_and_transformers(checkpoint) -> None:
    path, hf_model = checkpoint
    rng = random.Random(0)
    lengths = [3, 300] + [rng.randint(3, 300) for _ in range(18)]
    prompts = [[rng.randrange(4, 97) for _ in range(n)] for n in lengths]
    max_tokens = [1, 64] + [rng.randint(1, 64) for _ in range(18)]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    llm = LLM(dtype="float32", model=str(path), num_kv_slots=1024, max_num_batched_tokens=96, page_size=4)
    try:
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
        alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    finally:
        llm.shutdown()
    assert stats["scheduler"]["preemptions"] > 0
    assert stats["scheduler"]["chunked_prefills"] > 0
    assert stats["scheduler"]["mixed_steps"] > 0
    assert stats["scheduler"]["max_batch_tokens"] <= 96
    assert [len(b) for b in batched] == max_tokens
    assert batched == alone
    for prompt, m, ours in zip(prompts, max_tokens, batched):
        assert ours == hf_greedy(hf_model, prompt, m)


def test_pool_returns_to_baseline_and_rows_are_free(llm: LLM) -> None:
    llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["running"] == stats["waiting"] == stats["active_requests"] == 0
    assert stats["free_rows"] == llm.engine.config.max_running_requests
    used = stats["kv_capacity_pages"] - stats["kv_free_pages"]
    assert used == stats["kv_cached_pages"]  # only the prefix cache holds pages


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_k=2.5), "top_k"),
        (dict(logit_bias={1000: 1.0}), "logit_bias"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_parameters_are_rejected_and_engine_keeps_serving(llm: LLM, kwargs: dict, param: str) -> None:
    with pytest.raises(ParameterError, match=param) as refused:
        llm.generate(["hello world"], SamplingParams(**kwargs), use_tqdm=False)
    assert refused.value.param == param
    out = llm.generate(["hello world"], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_bad_prompts_are_rejected_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt \(600 tokens\) \+ max_tokens \(16\) = 616 exceeds"):
        llm.generate([[5] * 600], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 5000]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be a string or a list of token ids"):
        llm.generate([3.5], use_tqdm=False)
    before = llm.engine.stats()
    with pytest.raises(ValueError, match="max_tokens"):  # second prompt bad: first must not run either
        llm.generate(["hello", "world"], [SamplingParams(), SamplingParams(max_tokens=-1)], use_tqdm=False)
    assert llm.engine.stats()["scheduler"]["steps"] == before["scheduler"]["steps"]


def test_engine_caps_apply_to_the_python_api(checkpoint) -> None:
    llm = LLM(
        dtype="float32", model=str(checkpoint[0]), num_kv_slots=256, max_n=2, max_top_logprobs=1, max_tokens_cap=4
    )
    try:
        for params, param in [
            (SamplingParams(n=3, max_tokens=2), "n"),
            (SamplingParams(logprobs=2, max_tokens=2), "logprobs"),
            (SamplingParams(max_tokens=5), "max_tokens"),
        ]:
            with pytest.raises(ParameterError) as refused:
                llm.generate([[5, 6, 7]], params, use_tqdm=False)
            assert refused.value.param == param
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, **GREEDY), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4  # no max_tokens: the cap
    finally:
        llm.shutdown()


def test_a_text_prompt_is_tokenized_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = llm.engine.tokenizer
    calls: list[str] = []
    encode = tokenizer.encode

    def counting_encode(text: str, *args, **kwargs) -> list[int]:
        calls.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    llm.generate(["hello world", "the cat"], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert calls == ["hello world", "the cat"]


def test_a_state_runs_once_and_ids_stay_unique_until_finished(llm: LLM) -> None:
    engine = llm.engine
    done: list[RequestOutput] = []
    params = SamplingParams(max_tokens=3, **GREEDY)
    state = engine.intake([5, 6, 7], params, done.append, request_id="same-id")
    engine.submit(state)
    with pytest.raises(ValueError, match="already submitted"):
        engine.submit(state)
    twin = engine.intake([5, 6, 7], params, done.append, request_id="same-id")  # before the first finished
    with pytest.raises(ValueError, match="already in use"):
        engine.submit(twin)
    out = llm.generate([[8, 9]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]  # still serving
    assert len(out.outputs[0].token_ids) == 2
    deadline = time.monotonic() + 30
    while not (done and done[-1].finished) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done[-1].finished and done[-1].request_id == "same-id"
    engine.submit(engine.intake([5, 6], params, lambda _: None, request_id="same-id"))  # free again


def test_changing_params_after_intake_changes_nothing(llm: LLM) -> None:
    engine = llm.engine
    done: list[RequestOutput] = []
    params = SamplingParams(max_tokens=6, stop_token_ids=[], **GREEDY)
    free = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    state = engine.intake([5, 6, 7], params, done.append)
    params.stop_token_ids.append(free[1])  # would stop after two tokens if the engine read it
    params.max_tokens = 2
    engine.submit(state)
    deadline = time.monotonic() + 30
    while not (done and done[-1].finished) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t for d in done for o in d.outputs for t in o.token_ids] == free


def test_stop_strings_cut_text_exactly(llm: LLM) -> None:
    prompt = [7, 8, 9, 10, 11]
    full = llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    assert len(words) >= 6
    # a stop string spanning the boundary between the 3rd and 4th generated words
    stop = f"{words[2][-1:]} {words[3][:1]}"
    cut = full.text.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        [prompt], SamplingParams(max_tokens=12, stop=stop, include_stop_str_in_output=True, **GREEDY), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: cut + len(stop)]
    # generation stops at the first token whose text completes the stop string
    completes = min(k for k in range(1, len(words) + 1) if stop in " " + " ".join(words[:k]))
    assert out.token_ids == full.token_ids[:completes]


def test_streaming_deltas_concatenate_to_the_full_output(llm: LLM, checkpoint) -> None:
    prompt = [7, 8, 9, 10, 11]
    full = llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = f"{words[4]} {words[5][:1]}"
    expected = full.text[: full.text.index(stop)]

    async def stream() -> list[RequestOutput]:
        engine = AsyncEngine(llm.engine)
        return [d async for d in engine.generate(prompt, SamplingParams(max_tokens=12, stop=stop, **GREEDY))]

    deltas = asyncio.run(stream())
    assert len(deltas) >= 3
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == expected
    assert all(not stop.startswith(d.outputs[0].text) or not d.outputs[0].text for d in deltas[:-1] if d.outputs)
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"


def test_n_completions_compute_the_prompt_once(llm: LLM) -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    sampling = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    before = llm.engine.stats()["scheduler"]["prompt_tokens_computed"]
    out = llm.generate([prompt], SamplingParams(n=4, seed=3, **sampling), use_tqdm=False)[0]
    computed = llm.engine.stats()["scheduler"]["prompt_tokens_computed"] - before
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert computed == len(prompt)  # siblings are forked from sequence 0's computed prompt
    # sibling i samples with seed + i * SIBLING_SEED_STRIDE: it is that request run alone (n=1)
    alone = llm.generate(
        [prompt] * 4,
        [SamplingParams(seed=3 + i * SIBLING_SEED_STRIDE, **sampling) for i in range(4)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in alone]


def test_seed_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * 3
    mixed = llm.generate(
        [[9, 9, 9, 9], [5, 6, 7], [20, 21], [30]], [noise[0], seeded, noise[1], noise[2]], use_tqdm=False
    )
    assert mixed[1].outputs[0].token_ids == alone
    other = (
        llm.generate(
            [[5, 6, 7]], SamplingParams(temperature=1.0, seed=4321, max_tokens=10, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other != alone


def test_seeded_request_alone_and_in_a_200_request_batch(checkpoint) -> None:
    """Alone, a decode step has one row; amid 199 others, more than 128: the projections take other
    kernels (skinny, panel, oneDNN), so logits may differ in their last bits. What is guaranteed
    (README): the same distribution to rounding (logprobs within 1e-4) and so the same seeded tokens,
    unless a draw falls within rounding of a boundary between two tokens' cumulative probabilities."""
    path, _ = checkpoint
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True, logprobs=5)
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True) for i in range(199)]
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 97) for _ in range(rng.randint(2, 6))] for _ in range(199)]
    llm = LLM(
        dtype="float32",
        model=str(path),
        num_kv_slots=4096,
        max_running_requests=256,
        max_num_batched_tokens=1024,
        skip_tokenizer_init=True,
    )
    try:
        alone = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)[0].outputs[0]
        batch = llm.generate(
            prompts[:100] + [[5, 6, 7]] + prompts[100:], others[:100] + [seeded] + others[100:], use_tqdm=False
        )
        in_batch = batch[100].outputs[0]
    finally:
        llm.shutdown()
    assert in_batch.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, in_batch.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)


def test_logit_bias_and_logprobs_through_the_engine(llm: LLM) -> None:
    out = llm.generate(
        [[5, 6]],
        SamplingParams(max_tokens=4, temperature=0.8, logit_bias={42: 100.0}, logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == [42] * 4
    assert len(out.logprobs) == 4 and all(42 in lp and len(lp) <= 3 for lp in out.logprobs)


def test_abort_mid_decode_releases_pages(checkpoint) -> None:
    llm = LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=2048, enable_prefix_caching=False)
    engine = llm.engine
    try:
        got_tokens = threading.Event()
        finished = threading.Event()
        final: list[RequestOutput] = []

        def on_output(delta: RequestOutput) -> None:
            if delta.outputs and delta.outputs[0].token_ids:
                got_tokens.set()
            if delta.finished:
                final.append(delta)
                finished.set()

        rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=400, **GREEDY), on_output)
        assert got_tokens.wait(30)
        engine.abort(rid)
        assert finished.wait(30)
        assert final[0].outputs[0].finish_reason == "abort"
        stats = engine.stats()
        assert stats["kv_free_pages"] == stats["kv_capacity_pages"]
        assert stats["free_rows"] == engine.config.max_running_requests
    finally:
        llm.shutdown()


def test_unbounded_max_tokens_stops_at_the_kv_limit(checkpoint) -> None:
    llm = LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=64, enable_prefix_caching=False)
    try:
        out = llm.generate([list(range(5, 15))], SamplingParams(max_tokens=None, **GREEDY), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 63 - 10  # 63 usable slots (slot 0 is reserved)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "kwargs, param",
    [(dict(top_k=2**63), "top_k"), (dict(seed=2**64), "seed"), (dict(repetition_penalty=1e-308), "repetition_penalty")],
)
def test_out_of_range_values_fail_only_their_request(llm: LLM, kwargs: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=1.0, **kwargs), use_tqdm=False)


def test_tiny_temperature_and_top_p_stay_well_defined(llm: LLM) -> None:
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0].outputs[0]
    for kwargs in (dict(temperature=1e-308), dict(temperature=1.0, top_p=1e-308)):
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, **kwargs), use_tqdm=False)
        assert out[0].outputs[0].token_ids == greedy.token_ids


def test_the_loop_thread_builds_the_model_and_cache(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model worker (model, KV storage) is made on the engine's own thread (the caller's thread
    then has no OpenMP team of torch's competing with the loop's), and a failing build raises from
    the constructor."""
    from tokenmill.worker import model_worker as engine_module

    builders: list[str] = []
    load_model, storage = engine_module.load_repacked, engine_module.KVStorage  # (a CPU model at tp=1)

    def spy_load(*args, **kwargs):
        builders.append(threading.current_thread().name)
        return load_model(*args, **kwargs)

    def spy_storage(*args, **kwargs):
        builders.append(threading.current_thread().name)
        return storage(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_repacked", spy_load)
    monkeypatch.setattr(engine_module, "KVStorage", spy_storage)
    llm = LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=256, skip_tokenizer_init=True)
    try:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert builders == ["tokenmill-engine", "tokenmill-engine"]

    def failing_storage(*args, **kwargs):
        raise MemoryError("no room for the KV cache")

    monkeypatch.setattr(engine_module, "KVStorage", failing_storage)
    with pytest.raises(MemoryError, match="no room"):
        LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=256, skip_tokenizer_init=True)


def test_counting_work_never_holds_up_a_generations_tokenization(llm: LLM) -> None:
    """Every thread of the counting pool busy (``/tokenize``, ``count_tokens`` work): a text prompt is
    still tokenized, on the tokenizer pool, and generated."""
    engine = AsyncEngine(llm.engine)
    release = threading.Event()

    async def scenario() -> list[RequestOutput]:
        busy = [
            asyncio.ensure_future(engine.run_counting(lambda: release.wait(60)))
            for _ in range(llm.engine.config.tokenizer_threads)
        ]
        await asyncio.sleep(0.05)  # the pool's threads are all taken now
        try:
            return [d async for d in engine.generate("hello world", SamplingParams(max_tokens=3, **GREEDY))]
        finally:
            release.set()
            await asyncio.gather(*busy)

    deltas = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert deltas[-1].finished and sum(len(d.outputs[0].token_ids) for d in deltas) == 3  # deltas: new tokens


def test_a_call_of_many_prompts_takes_its_share_not_the_queue(checkpoint) -> None:
    """40 prompts of one call wait for 2 rows; a one-prompt call submitted after them is admitted at
    the next free row (its call has none running), not after the 40: it finishes among the first."""
    llm = LLM(dtype="float32", model=str(checkpoint[0]), num_kv_slots=2048, max_running_requests=2)
    finished: list[str] = []
    done = threading.Event()

    def on_delta(delta: RequestOutput) -> None:
        if delta.finished:
            finished.append(delta.request_id)
            if len(finished) == 41:
                done.set()

    try:
        params = SamplingParams(max_tokens=8, **GREEDY)
        for i in range(40):
            llm.engine.add_request([5, 6, 7 + i], params, on_delta, f"big-{i}", call_id="big")
        llm.engine.add_request([9, 8, 7], params, on_delta, "small")
        assert done.wait(60)
    finally:
        llm.shutdown()
    assert finished.index("small") <= 3, finished
    assert [r for r in finished if r != "small"] == [f"big-{i}" for i in range(40)]  # FIFO within the call
