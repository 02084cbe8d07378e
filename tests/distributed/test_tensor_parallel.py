"""Tensor parallelism on CPU (gloo, two processes): tp=2 against tp=1 and transformers through the
engine, and the lifecycle of the worker processes (shutdown, interpreter exit, a worker's death).

One tp=2 engine per family for the whole module (spawning a worker costs seconds): llama (KV heads
split), qwen3 with one KV head (replicated on both ranks, q/k norms) and mixtral (sharded experts).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tokenmill.worker.model_worker as model_worker_module
from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, PoolingParams, SamplingParams
from tokenmill.model.weights import WeightError
from tokenmill.request import RequestOutput

FAMILIES = {
    "llama": {},
    "qwen3": dict(num_key_value_heads=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
}
ENGINE = dict(
    dtype="float32",
    attention_backend="cpu",
    page_size=4,
    num_kv_slots=64,  # less than the five requests need at once: preemption
    max_num_batched_tokens=16,  # prompts of 5-40 tokens: chunked prefill
)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    made = {}
    for kind, overrides in FAMILIES.items():
        path = tmp_path_factory.mktemp(kind)
        hf_model = save_tiny_checkpoint(path, kind, **overrides)
        hf_model.generation_config.eos_token_id = None
        made[kind] = path, hf_model
    return made


class TensorParallelLLMs:
    """One tp=2 LLM at a time (a process runs one tensor-parallel engine at a time)."""

    def __init__(self, checkpoints: dict[str, tuple[Path, object]]) -> None:
        self.checkpoints = checkpoints
        self.key: tuple[str, str] | None = None
        self.llm: LLM | None = None

    def __getitem__(self, kind: str) -> LLM:
        return self.get(kind)

    def get(self, kind: str, runner: str = "generate") -> LLM:
        """The tp=2 engine of ``kind`` with ``runner`` (started unless it is the one running)."""
        if (kind, runner) != self.key:
            self.close()
            self.llm = LLM(model=str(self.checkpoints[kind][0]), tensor_parallel_size=2, runner=runner, **ENGINE)
            self.key = kind, runner
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
        self.key = self.llm = None


@pytest.fixture(scope="module")
def tp2(checkpoints) -> Iterator[TensorParallelLLMs]:
    llms = TensorParallelLLMs(checkpoints)
    yield llms
    llms.close()


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(4, 97) for _ in range(8)]  # shared: prefix-cache hits
    return [prefix + [rng.randrange(4, 97) for _ in range(rng.randint(0, 32))] for _ in range(n - 1)] + [[5, 6]]


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3", "llama"])  # llama last: the next tests reuse it
def test_greedy_tp2_equals_tp1_and_transformers_under_chunking_and_preemption(kind, checkpoints, tp2) -> None:
    path, hf_model = checkpoints[kind]
    batch = prompts(5)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = tp2[kind]
    before = llm.engine.stats()["scheduler"]["preemptions"]
    got = token_ids(llm.generate(batch, params, use_tqdm=False))
    assert llm.engine.stats()["scheduler"]["preemptions"] > before
    tp1 = LLM(model=str(path), **ENGINE)
    try:
        expected = token_ids(tp1.generate(batch, params, use_tqdm=False))
    finally:
        tp1.shutdown()
    assert got == expected
    assert got == [hf_greedy(hf_model, p, NEW_TOKENS) for p in batch]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_tp2_equal_transformers_under_chunking(pooling, checkpoints, tp2) -> None:
    """Pooling steps carry ``hidden_indices`` to the worker too (its forward must match rank 0's)."""
    hf_model = checkpoints["llama"][1]
    batch = prompts(5)
    outputs = tp2.get("llama", "pooling").embed(batch, PoolingParams(pooling=pooling, normalize=False), use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        with torch.no_grad():
            hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
        expected = hidden[-1] if pooling == "last" else hidden.mean(0)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-4, rtol=0)


def test_seeded_sampling_tp2_equals_tp1(checkpoints, tp2) -> None:
    """Same tokens; logprobs equal up to the reduction order of the sharded products."""
    path, _ = checkpoints["llama"]
    batch = prompts(4)
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=i, logprobs=2) for i in range(4)]
    got = tp2["llama"].generate(batch, params, use_tqdm=False)
    tp1 = LLM(model=str(path), **ENGINE)
    try:
        expected = tp1.generate(batch, params, use_tqdm=False)
    finally:
        tp1.shutdown()
    assert token_ids(got) == token_ids(expected)
    diffs = [
        abs(a[t].logprob - b[t].logprob)
        for x, y in zip(got, expected)
        for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs)
        for t in a
    ]
    assert max(diffs) < 1e-5


def worker_processes() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("tokenmill-tp-worker")]


def pid_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def test_weight_update_tp2_equals_tp1_and_a_refusal_by_any_rank_applies_on_none(checkpoints, tp2, tmp_path) -> None:
    """A folder update at tp=2 gives tp=1's tokens with the same update; an update refused by rank 0
    (NaN) or by the worker alone (a float64 value that overflows float32 only in rank 1's rows of
    q_proj) leaves every rank's weights, the tokens and the version as they were."""
    path, _ = checkpoints["llama"]
    llm = tp2["llama"]
    batch, params = prompts(3), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    before, version = token_ids(llm.generate(batch, params, use_tqdm=False)), llm.weight_version
    base = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    changed = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ]
    update = [(n, base[n] + 0.5 * torch.randn(base[n].shape, generator=gen)) for n in changed]

    nan = update[0][1].clone()
    nan[0, 0] = float("nan")
    with pytest.raises(WeightError, match="non-finite"):
        llm.update_weights([update[1], (changed[0], nan)])
    overflow = update[0][1].double()
    overflow[-1, 0] = 1e300
    with pytest.raises(WeightError, match="tensor-parallel rank 1 refused the update: .*q_proj.* non-finite"):
        llm.update_weights([update[1], (changed[0], overflow)])
    assert llm.weight_version == version
    assert token_ids(llm.generate(batch, params, use_tqdm=False)) == before

    shutil.copytree(path, tmp_path / "updated")
    save_file({**base, **dict(update)}, tmp_path / "updated" / "model.safetensors", metadata={"format": "pt"})
    assert llm.update_weights(str(tmp_path / "updated")) == version + 1
    got = token_ids(llm.generate(batch, params, use_tqdm=False))
    tp1 = LLM(model=str(path), **ENGINE)
    try:
        tp1.update_weights(update)
        expected = token_ids(tp1.generate(batch, params, use_tqdm=False))
    finally:
        tp1.shutdown()
    assert got == expected != before


def test_shutdown_stops_the_workers(tp2) -> None:
    """Ends the module's llama engine."""
    llm = tp2["llama"]
    pids = [p.pid for p in llm.engine.executor.group.processes]
    llm.shutdown()
    assert not llm.engine.is_healthy()
    assert worker_processes() == [] and not any(pid_exists(pid) for pid in pids)


def test_killed_worker_fails_requests_and_the_engine_and_leaves_no_process(checkpoints, tp2) -> None:
    tp2.close()
    llm = LLM(model=str(checkpoints["llama"][0]), tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    outputs: list[RequestOutput] = []
    done, started = threading.Event(), threading.Event()

    def on_output(output: RequestOutput) -> None:
        outputs.append(output)
        started.set()
        if output.finished:
            done.set()

    try:
        (worker,) = worker_processes()
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), on_output)
        assert started.wait(30)
        os.kill(worker.pid, signal.SIGKILL)
        assert done.wait(30)  # the collective fails at once (connection reset), well before any timeout
        final = outputs[-1].outputs[0]
        assert final.finish_reason == "error" and "tp-worker-1 exited" in final.error
        assert not engine.is_healthy()
        with pytest.raises(RuntimeError, match="not running"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert worker_processes() == [] and not pid_exists(worker.pid)


def test_worker_hung_while_idle_turns_the_engine_unhealthy_and_is_killed_on_shutdown(checkpoints, tp2) -> None:
    """Every worker answers the watchdog's heartbeat, so a hung (stopped) worker is found with no request running."""
    tp2.close()
    llm = LLM(model=str(checkpoints["llama"][0]), tensor_parallel_size=2, distributed_timeout_s=2, **ENGINE)
    (worker,) = worker_processes()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60  # bounds a wait that only a broken watchdog reaches
        while llm.engine.is_healthy():
            assert time.monotonic() < deadline, "a hung worker went unnoticed"
            time.sleep(0.05)
        assert "heartbeat failed" in llm.engine.executor.group.failure
        with pytest.raises(RuntimeError, match="not running"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert worker_processes() == [] and not pid_exists(worker.pid)


EXIT_SCRIPT = """
from tokenmill import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model={path!r}, tensor_parallel_size=2, dtype="float32", num_kv_slots=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    print(llm.engine.executor.group.processes[0].pid, flush=True)
"""


def test_no_worker_outlives_the_interpreter_without_shutdown(checkpoints, tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT.format(path=str(checkpoints["llama"][0])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    assert not pid_exists(pid)


def test_a_build_failing_on_rank_0_stops_the_starting_workers(checkpoints, tp2, monkeypatch) -> None:
    """Rank 0's build fails after its workers started (here: sizing its KV cache), while they still
    load or wait for the KV size agreement: they get no step message (a collective they are not in),
    are stopped, the group is left, and the failure reaches the caller; a new engine then starts."""
    tp2.close()

    def fail(*args, **kwargs):
        raise RuntimeError("rank 0 cannot size its KV cache")

    with monkeypatch.context() as patch:
        patch.setattr(model_worker_module, "kv_cache_slots", fail)
        with pytest.raises(RuntimeError, match="rank 0 cannot size its KV cache"):
            LLM(model=str(checkpoints["llama"][0]), tensor_parallel_size=2, distributed_timeout_s=300, **ENGINE)
    assert worker_processes() == []
    assert not torch.distributed.is_initialized()
    llm = tp2["llama"]
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_speculative_decoding_tp2_equals_transformers(checkpoints, tp2) -> None:
    """Verifications (one-token requests sharing a row) run on both ranks as any decode step does."""
    tp2.close()  # one tensor-parallel engine per process at a time
    path, hf_model = checkpoints["llama"]
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 8}
    batch = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10]]
    params = SamplingParams(max_tokens=2 * NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), tensor_parallel_size=2, speculative_config=speculative, **ENGINE)
    try:
        got = token_ids(llm.generate(batch, params, use_tqdm=False))
        stats = llm.engine.stats()["speculative"]
    finally:
        llm.shutdown()
    assert stats["accepted_tokens"] > 0
    assert got == [hf_greedy(hf_model, p, 2 * NEW_TOKENS) for p in batch]
