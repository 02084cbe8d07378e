"""Weight updates under load: no torn weights, versions tagged per token, all-or-nothing
validation (every failure leaves weights, version and prefix cache as they were), updates equal to
transformers with the same weights, and no reuse of KV computed under old weights after a cache flush."""

from __future__ import annotations

import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, Engine, SamplingParams
from tokenmill.model.loader import WeightError, load_model
from tokenmill.model.weights import checkpoint_targets
from tokenmill.request import ParameterError, RequestOutput, accumulate
from tokenmill.worker.weight_update import apply_update, stage_update

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PERTURBED = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)] + ["model.layers.0.self_attn.k_proj.weight"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rl-llama")
    save_tiny_checkpoint(path, "llama")
    return path


def weights_for(base: dict[str, torch.Tensor], version: int) -> list[tuple[str, torch.Tensor]]:
    """Version k: the base weights of PERTURBED plus a perturbation seeded by k (not cumulative)."""
    gen = torch.Generator().manual_seed(version)
    return [(n, base[n] + 0.5 * torch.randn(base[n].shape, generator=gen)) for n in PERTURBED]


def checkpoint_of(checkpoint: Path, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """``checkpoint``'s config and tokenizer with ``weights`` in its safetensors file, saved to ``folder``."""
    shutil.copytree(checkpoint, folder)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def generate_observed(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[RequestOutput, list[int]]:
    """The request's output, and for each of its tokens the engine's weight version when the delta carrying the
    token was emitted: callbacks run on the engine thread right after the step that sampled the delta's tokens,
    and a weight update only ever applies between steps, so that is the version that produced the token."""
    done = threading.Event()
    total: list[RequestOutput | None] = [None]
    observed: list[int] = []

    def on_output(delta: RequestOutput) -> None:
        version = engine.weight_version
        total[0] = accumulate(total[0], delta)
        observed.extend([version] * sum(len(c.token_ids) for c in delta.outputs))
        if delta.finished:
            done.set()

    engine.add_request(prompt, params, on_output)
    assert done.wait(60)
    return total[0], observed


def test_concurrent_generation_and_twenty_updates(checkpoint: Path, tmp_path: Path) -> None:
    base = load_file(checkpoint / "model.safetensors")
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=4096)
    engine = llm.engine
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    records: list[tuple[int, list[int], RequestOutput, list[int]]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()

    def generate_forever(worker: int) -> None:
        try:
            while not stop.is_set():
                prompt = prompts[worker]
                started_version = engine.weight_version
                out, observed = generate_observed(engine, prompt, GREEDY)
                with lock:
                    records.append((started_version, prompt, out, observed))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=generate_forever, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    try:
        for version in range(1, 21):
            assert llm.update_weights(weights_for(base, version)) == version
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # let two requests run wholly under this version
                with lock:
                    if sum(started == version for started, *_ in records) >= 2:
                        break
                time.sleep(0.005)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not errors
    assert engine.weight_version == 20
    assert len(records) >= 40
    llm.shutdown()
    for _, _, out, observed in records:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 6
        assert completion.weight_versions == observed  # each token carries the version that produced it
    assert any(len(set(observed)) > 1 for *_, observed in records)  # some requests ran across an update

    # requests that ran entirely under one version k produce the greedy tokens of an engine freshly loaded
    # from a checkpoint holding weights k (the reference never goes through update_weights)
    by_version: dict[int, dict[tuple, list[int]]] = {}
    for started, prompt, out, _ in records:
        versions = set(out.outputs[0].weight_versions)
        if len(versions) == 1 and started <= min(versions):
            by_version.setdefault(versions.pop(), {})[tuple(prompt)] = out.outputs[0].token_ids
    assert len(by_version) >= 3
    for version, outputs in sorted(by_version.items()):
        weights = {**base, **dict(weights_for(base, version))} if version else base
        fresh = LLM(
            dtype="float32", model=str(checkpoint_of(checkpoint, weights, tmp_path / f"v{version}")), num_kv_slots=1024
        )
        try:
            got = fresh.generate([list(p) for p in outputs], GREEDY, use_tqdm=False)
        finally:
            fresh.shutdown()
        assert [o.outputs[0].token_ids for o in got] == list(outputs.values()), f"weights of version {version}"


@pytest.mark.parametrize(
    "bad, message",
    [
        (("model.layers.0.mlp.rogue.weight", torch.zeros(3)), "unexpected tensor 'model.layers.0.mlp.rogue.weight'"),
        (("model.layers.1.self_attn.v_proj.weight", torch.zeros(5, 64)), r"has shape \(5, 64\), expected \(32, 64\)"),
        (("model.norm.weight", torch.ones(64, dtype=torch.int32)), "has dtype int32, expected one of float32"),
        (("model.norm.weight", torch.ones(64).to(torch.float8_e4m3fn)), "has dtype float8_e4m3fn, expected one of"),
    ],
)
def test_invalid_update_changes_nothing(checkpoint: Path, bad: tuple, message: str) -> None:
    # no prefix cache: both runs take the same computation path, so outputs must be bit-identical
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=1024, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
        good = ("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 96))
        with pytest.raises(WeightError, match=message):
            llm.update_weights([good, bad, good])
        assert llm.weight_version == 0
        after = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
        assert after.token_ids == before.token_ids
        assert [lp[t].logprob for lp, t in zip(after.logprobs, after.token_ids)] == [
            lp[t].logprob for lp, t in zip(before.logprobs, before.token_ids)
        ]
    finally:
        llm.shutdown()


def test_flush_recomputes_cached_prompts_with_new_weights(checkpoint: Path, tmp_path: Path) -> None:
    new = tmp_path / "new"
    save_tiny_checkpoint(new, "llama", seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    prompt = list(range(10, 30))
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=1024)
    fresh = LLM(dtype="float32", model=str(new), num_kv_slots=1024)  # reference: loaded from the new checkpoint
    try:
        expected = fresh.generate([prompt], params, use_tqdm=False)[0].outputs[0]

        llm.generate([prompt], params, use_tqdm=False)  # caches the prompt under the old weights
        hits = llm.engine.stats()["cache"]["prefix_hit_tokens"]
        llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.stats()["cache"]["prefix_hit_tokens"] > hits  # the cache would be reused

        assert llm.update_weights(new, version=5) == 5
        hits = llm.engine.stats()["cache"]["prefix_hit_tokens"]
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert llm.engine.stats()["cache"]["prefix_hit_tokens"] == hits  # recomputed from scratch
        assert out.token_ids == expected.token_ids and out.weight_versions == [5] * 5
        for ours, ref, tok in zip(out.logprobs, expected.logprobs, out.token_ids):
            assert abs(ours[tok].logprob - ref[tok].logprob) <= 1e-5
    finally:
        llm.shutdown()
        fresh.shutdown()


def test_pause_holds_steps_and_resume_continues(checkpoint: Path) -> None:
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=1024)
    engine = llm.engine
    try:
        engine.pause_generation()
        done = threading.Event()
        total: list[RequestOutput | None] = [None]

        def collect(delta: RequestOutput) -> None:
            total[0] = accumulate(total[0], delta)
            if delta.finished:
                done.set()

        engine.add_request([5, 6, 7], GREEDY, collect)
        assert not done.wait(0.5)
        assert engine.stats()["scheduler"]["steps"] == 0
        engine.resume_generation()
        assert done.wait(30) and len(total[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


DOWN_0, DOWN_1 = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"  # [64, 96] each
SHARED_PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[LLM]:
    """An engine that has served a prompt: the prefix cache holds it, blocked weight copies are made.
    Tests using it leave it unchanged (they only try updates that must be refused)."""
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=1024)
    llm.generate([SHARED_PROMPT, [5, 6, 7, 8]], GREEDY, use_tqdm=False)
    yield llm
    llm.shutdown()


def engine_state(llm: LLM) -> tuple[dict[str, torch.Tensor], int, int]:
    """The model's tensors (copied), the weight version and the number of prefix-cached pages."""
    tensors = {name: t.detach().clone() for name, t in llm.engine.model.state_dict().items()}
    return tensors, llm.weight_version, llm.engine.stats()["kv_cached_pages"]


def assert_untouched(llm: LLM, before: tuple[dict[str, torch.Tensor], int, int]) -> None:
    """Same weights, version and prefix-cached pages as ``before``, and the cache still serves hits."""
    assert_same_state(llm, before)
    hits = llm.engine.stats()["cache"]["prefix_hit_tokens"]
    llm.generate([SHARED_PROMPT], GREEDY, use_tqdm=False)
    assert llm.engine.stats()["cache"]["prefix_hit_tokens"] == hits + len(SHARED_PROMPT) - 1  # cache still served


def assert_same_state(llm: LLM, before: tuple[dict[str, torch.Tensor], int, int]) -> None:
    tensors, version, cached_pages = engine_state(llm)
    assert tensors.keys() == before[0].keys()
    assert all(torch.equal(tensors[name], before[0][name]) for name in tensors), "weights changed"
    assert (version, cached_pages) == before[1:] and cached_pages > 0


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated in recent torch
        return torch.quantize_per_tensor(torch.zeros(64, 96), 0.1, 0, torch.qint8)


def with_value(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    tensor = torch.zeros(64, 96, dtype=dtype)
    tensor[3, 5] = value
    return tensor


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: torch.empty(64, 96, device="meta"), "is on device meta"),
        (lambda: torch.zeros(64, 96).to_sparse(), "is torch.sparse_coo, expected a dense strided tensor"),
        (quantized, "is quantized"),
        (lambda: torch.zeros(1, 96), r"has shape \(1, 96\), expected \(64, 96\)"),  # would broadcast
        (lambda: torch.zeros(96), r"has shape \(96,\), expected \(64, 96\)"),  # would broadcast
        (lambda: with_value(float("nan")), r"holds 1 non-finite value\(s\)"),
        (lambda: with_value(float("-inf")), r"holds 1 non-finite value\(s\)"),
        (lambda: with_value(1e300, torch.float64), "converted to torch.float32 holds 1 non-finite"),  # overflows
        (lambda: torch.zeros(64, 96), "appears more than once"),  # DOWN_1 twice
    ],
    ids=["meta", "sparse", "quantized", "row-broadcast", "vector-broadcast", "nan", "inf", "overflow", "duplicate"],
)
def test_refused_tensor_leaves_weights_version_and_prefix_cache_untouched(served: LLM, bad, message: str) -> None:
    before = engine_state(served)
    bad_name = DOWN_1 if message == "appears more than once" else DOWN_0
    with pytest.raises(WeightError, match=message):
        served.update_weights([(DOWN_1, torch.ones(64, 96)), (bad_name, bad())])
    assert_untouched(served, before)


@pytest.mark.parametrize("version", [2**63, -1, True, 1.0, "7", 0])
def test_refused_version_leaves_everything_untouched_and_aborts_nothing(served: LLM, version: object) -> None:
    before = engine_state(served)
    engine = served.engine
    engine.pause_generation()  # a request stays running across the refused update
    done = threading.Event()
    total: list[RequestOutput | None] = [None]

    def collect(delta: RequestOutput) -> None:
        total[0] = accumulate(total[0], delta)
        if delta.finished:
            done.set()

    try:
        engine.add_request([5, 6, 7], GREEDY, collect)
        with pytest.raises(ParameterError, match="^version ") as refused:
            served.update_weights([(DOWN_1, torch.ones(64, 96))], version=version, abort_running=True)
        assert refused.value.param == "version"
        assert_same_state(served, before)  # the request has not run yet: the cache is as it was
    finally:
        engine.resume_generation()
    assert done.wait(30) and total[0].outputs[0].finish_reason == "length"  # not aborted


def test_versions_stop_at_the_int64_maximum(checkpoint: Path) -> None:
    llm = LLM(dtype="float32", model=str(checkpoint), num_kv_slots=256, enable_prefix_caching=False)
    try:
        assert llm.update_weights([(DOWN_1, torch.ones(64, 96))], version=2**63 - 1) == 2**63 - 1
        with pytest.raises(ParameterError, match=r"version must lie in \[0, 2\*\*63 - 1\], got 9223372036854775808"):
            llm.update_weights([(DOWN_1, torch.zeros(64, 96))])
        assert llm.weight_version == 2**63 - 1
        assert torch.equal(llm.engine.model.state_dict()["model.layers.1.mlp.down_proj.weight"], torch.ones(64, 96))
    finally:
        llm.shutdown()


def test_a_folder_is_read_when_staged_and_not_again_when_applied(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint rewritten between validation and the step boundary: the update applies the
    tensors as they were validated, all of them, never a mix of the two files."""
    model = load_model(checkpoint, torch.float32, "cpu")
    first = {name: torch.full((64, 96), 0.25) for name in (DOWN_0, DOWN_1)}
    rewritten = {DOWN_0: torch.full((64, 96), float("nan")), DOWN_1: torch.full((64, 48), 2.0)}
    save_file(first, tmp_path / "model.safetensors")
    staged = stage_update(model, tmp_path)
    save_file(rewritten, tmp_path / "model.safetensors")  # now invalid: NaN and a wrong shape
    apply_update(staged)
    targets = checkpoint_targets(model)
    for name, tensor in first.items():
        target = targets[name]
        assert torch.equal(target.param[target.index], tensor)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_update_equals_transformers_with_the_same_weights(tmp_path: Path, tied: bool) -> None:
    """Packed rows (k_proj into qkv, up_proj into gate_up), the embedding (also the LM head when
    tied), the LM head, a non-contiguous and an fp64 tensor: after the update the engine's greedy
    tokens and their logprobs are transformers' with the same weights, though blocked weight copies
    and the prefix cache were made under the old ones."""
    hf_model = save_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    hf_model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(11)
    update = {
        "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64, generator=gen) * 0.1,
        "model.embed_tokens.weight": torch.randn(97, 64, generator=gen, dtype=torch.float64) * 0.1,
        "model.norm.weight": 1 + torch.randn(64, generator=gen) * 0.1,
    }
    update["model.layers.1.mlp.up_proj.weight"] = torch.randn(64, 96, generator=gen).t() * 0.1  # non-contiguous
    if not tied:
        update["lm_head.weight"] = torch.randn(97, 64, generator=gen) * 0.1
    prompts = [SHARED_PROMPT, [5, 6, 7, 8, 9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    llm = LLM(dtype="float32", model=str(tmp_path), num_kv_slots=1024)
    try:
        llm.generate(prompts, params, use_tqdm=False)  # old weights: prefix cache and blocked copies
        assert llm.update_weights(list(update.items())) == 1
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    hf_params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, tensor in update.items():
            hf_params[name].copy_(tensor)
    for prompt, out in zip(prompts, got):
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(ids).logits[0, len(prompt) - 1 :].float(), dim=-1)
        assert out.token_ids == logprobs.argmax(-1).tolist()
        for step, token in enumerate(out.token_ids):
            assert abs(out.logprobs[step][token].logprob - float(logprobs[step, token])) <= 1e-4
