"""The KV disk tier through the engine: prefixes served from disk after a restart and after device
eviction equal transformers and the run that computed them; another model, new weights, a corrupt
or partial file, a kill mid-write are never served; bad settings fail at start."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.cache.disk_block_file import SUFFIX
from tokenmill.cache.disk_directory import DiskTierError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("tier-llama")
    hf_model = save_tiny_checkpoint(path, "llama", max_position_embeddings=1024)
    hf_model.generation_config.eos_token_id = None
    return path, hf_model


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 97) for _ in range(length)] for _ in range(n)]


def engine(model: Path, tier: Path, **overrides: object) -> LLM:
    options = dict(dtype="float32", model=str(model), num_kv_slots=2048, kv_cache_disk_dir=str(tier))
    return LLM(**{**options, **overrides})


def run(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple[list[int], int]]:
    """Each prompt's tokens and the prompt tokens it did not compute (from any cache tier)."""
    outputs = llm.generate(batch, [params] * len(batch), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]


def tier_stats(llm: LLM) -> dict:
    return llm.engine.stats()["disk_tier"]


def run_fresh(model: Path, tier: Path, batch: list[list[int]], **overrides: object) -> tuple[list, dict]:
    """``batch`` run by a fresh engine on ``tier`` that then shuts down cleanly (a server's start and
    stop): ``run``'s results and the tier's counters."""
    llm = engine(model, tier, **overrides)
    try:
        return run(llm, batch), tier_stats(llm)
    finally:
        llm.shutdown()


def tokens_logprobs_cached(outputs: list) -> list[tuple[list[int], list[float], int]]:
    """Each output's tokens, their logprobs and its prompt tokens served from a cache tier."""
    return [
        (
            o.outputs[0].token_ids,
            [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            o.num_cached_tokens,
        )
        for o in outputs
    ]


def blocks(tier: Path) -> list[Path]:
    return sorted(tier.glob(f"*{SUFFIX}"))


def blocks_written(tier: Path, timeout: float = 30.0) -> list[Path]:
    """The tier's block files once there are some: a running engine's tier writes in the background,
    after the step that computed them (or when its loop goes idle)."""
    deadline = time.monotonic() + timeout
    while not blocks(tier) and time.monotonic() < deadline:
        time.sleep(0.02)
    return blocks(tier)


@pytest.mark.parametrize("page_size", [1, 16])
def test_restart_serves_prefix_from_disk_equal_to_transformers(checkpoint, tmp_path: Path, page_size: int) -> None:
    path, hf_model = checkpoint
    batch = prompts(2, 300)
    first, _ = run_fresh(path, tmp_path, batch, page_size=page_size)
    assert [cached for _, cached in first] == [0, 0]
    assert len(blocks(tmp_path)) == 2 * (308 // 64)  # each sequence's whole blocks, output tokens included
    second, stats = run_fresh(path, tmp_path, batch, page_size=page_size)
    assert [cached for _, cached in second] == [256, 256]  # 4 blocks of 64; the rest computed
    assert stats["hit_tokens"] == 512 and stats["rejected_files"] == 0
    for (tokens, _), (again, _), prompt in zip(first, second, batch):
        assert again == tokens == hf_greedy(hf_model, prompt, 8)


def test_fp8_blocks_round_trip_and_another_kv_dtype_never_reads_them(checkpoint, tmp_path: Path) -> None:
    """An fp8 cache's blocks, read back after a restart, give exactly the tokens and logprobs of the
    run that computed them; the tier's namespace holds the KV dtype, so an e5m2 or int8 engine on
    the same directory computes everything again."""
    path, _ = checkpoint
    batch = prompts(2, 300, seed=7)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    results = []
    for kv in ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2", "int8"):
        llm = engine(path, tmp_path, kv_cache_dtype=kv)
        try:
            outputs = llm.generate(batch, [params] * 2, use_tqdm=False)
        finally:
            llm.shutdown()
        results.append(tokens_logprobs_cached(outputs))
    assert [[cached for *_, cached in run] for run in results] == [[0, 0], [256, 256], [0, 0], [0, 0]]
    for (tokens, logprobs, _), (again, again_logprobs, _) in zip(results[0], results[1]):
        assert again == tokens and again_logprobs == pytest.approx(logprobs, abs=1e-5)


def test_int8_blocks_carry_their_scales(checkpoint, tmp_path: Path) -> None:
    """An int8 cache's blocks are written with their scales: after a restart the prefix read back
    gives exactly the tokens and logprobs the run that computed it gave."""
    path, _ = checkpoint
    batch = prompts(2, 300, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    results = []
    for _ in range(2):
        llm = engine(path, tmp_path, kv_cache_dtype="int8")
        try:
            outputs = llm.generate(batch, [params] * 2, use_tqdm=False)
        finally:
            llm.shutdown()
        results.append(tokens_logprobs_cached(outputs))
    (first, second) = results
    assert [cached for *_, cached in first] == [0, 0] and [cached for *_, cached in second] == [256, 256]
    for (tokens, logprobs, _), (again, again_logprobs, _) in zip(first, second):
        assert again == tokens and again_logprobs == pytest.approx(logprobs, abs=1e-5)


def test_pool_smaller_than_prefixes_reads_evicted_blocks_back(checkpoint, tmp_path: Path) -> None:
    """Eight 200-token prefixes cycle through a pool of 512 slots: the device evicts them, the disk
    tier serves them back (a run without it computes every prompt whole), with outputs equal to that
    run; chunked prefill runs beside the loads."""
    path, _ = checkpoint
    shared = prompts(8, 200, seed=1)
    batch = [shared[i % 8] + [4 + i] for i in range(24)]
    small = dict(num_kv_slots=512, max_num_batched_tokens=96, page_size=4)
    plain = LLM(dtype="float32", model=str(path), **small)
    try:
        expected = run(plain, batch)
    finally:
        plain.shutdown()
    got, stats = run_fresh(path, tmp_path, batch, **small)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert stats["hit_tokens"] == 16 * 192, stats  # every repeat's 3 blocks come back from disk
    assert sum(cached for _, cached in got) > sum(cached for _, cached in expected)


def test_another_model_never_reads_the_blocks(checkpoint, tmp_path: Path) -> None:
    path, _ = checkpoint
    other = tmp_path / "other"
    other_hf = save_tiny_checkpoint(other, "llama", seed=1, max_position_embeddings=1024)
    other_hf.generation_config.eos_token_id = None
    batch = prompts(1, 200)
    run_fresh(path, tmp_path / "tier", batch)
    assert blocks(tmp_path / "tier")
    ((tokens, cached),), _ = run_fresh(other, tmp_path / "tier", batch)
    assert cached == 0 and tokens == hf_greedy(other_hf, batch[0], 8)


def test_weight_update_invalidates_the_tier(checkpoint, tmp_path: Path) -> None:
    path, hf_model = checkpoint
    batch = prompts(1, 200, seed=2)
    llm = engine(path, tmp_path)
    try:
        run(llm, batch)
        assert blocks_written(tmp_path)
        name = "model.layers.0.mlp.down_proj.weight"
        new = dict(hf_model.named_parameters())[name].detach() + 0.5
        llm.update_weights([(name, new)])
        assert not blocks(tmp_path)  # the old weights' blocks are gone at once
        ((tokens, cached),) = run(llm, batch)
        assert cached == 0
        with torch.no_grad():
            updated = save_tiny_checkpoint(tmp_path / "updated", "llama", max_position_embeddings=1024)
            updated.load_state_dict(hf_model.state_dict())
            dict(updated.named_parameters())[name].copy_(new)
        updated.generation_config.eos_token_id = None
        assert tokens == hf_greedy(updated, batch[0], 8)
        assert blocks_written(tmp_path)  # blocks of the new weights
    finally:
        llm.shutdown()
    # a restart loads the files' weights: the updated weights' blocks must not serve
    ((tokens, cached),), _ = run_fresh(path, tmp_path, batch)
    assert cached == 0 and tokens == hf_greedy(hf_model, batch[0], 8)


def test_corrupt_and_partial_files_are_deleted_and_recomputed(checkpoint, tmp_path: Path) -> None:
    path, hf_model = checkpoint
    batch = prompts(1, 300, seed=3)
    run_fresh(path, tmp_path, batch)
    files = blocks(tmp_path)
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0xFF
    for file in files:  # which file holds the first block is unknown: damage every one differently
        file.write_bytes(bytes(data) if file == files[0] else file.read_bytes()[: len(data) // 2])
    (tmp_path / f"{'0' * 32}.tmp").write_bytes(b"partial")
    ((tokens, cached),), stats = run_fresh(path, tmp_path, batch)
    assert cached == 0 and tokens == hf_greedy(hf_model, batch[0], 8)
    assert stats["rejected_files"] == 1  # the first block failed its check: nothing past it is read
    assert not (tmp_path / f"{'0' * 32}.tmp").exists()


def test_kill_mid_write_leaves_nothing_served_wrong(checkpoint, tmp_path: Path) -> None:
    """A process writing blocks is killed with SIGKILL at once after its first step: a restart serves
    only whole, checked blocks and its outputs equal transformers'."""
    path, hf_model = checkpoint
    batch = prompts(6, 600, seed=4)
    script = textwrap.dedent(
        f"""
        import sys
        from tokenmill import LLM, SamplingParams
        llm = LLM(dtype="float32", model={str(path)!r}, num_kv_slots=8192, kv_cache_disk_dir={str(tmp_path)!r})
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        print("ready", flush=True)
        llm.generate({batch!r}, [params] * {len(batch)}, use_tqdm=False)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not blocks(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    got, stats = run_fresh(path, tmp_path, batch, num_kv_slots=8192)
    assert stats["rejected_files"] == 0
    for (tokens, _), prompt in zip(got, batch):
        assert tokens == hf_greedy(hf_model, prompt, 8)


def test_reset_prefix_cache_clears_the_tiers(checkpoint, tmp_path: Path) -> None:
    path, _ = checkpoint
    batch = prompts(1, 200, seed=5)
    llm = engine(path, tmp_path)
    try:
        run(llm, batch)
        assert run(llm, batch)[0][1] == 199  # a device hit: every token but the last
        llm.reset_prefix_cache()
        assert not blocks(tmp_path) and tier_stats(llm)["blocks"] == 0
        assert run(llm, batch)[0][1] == 0
    finally:
        llm.shutdown()


def test_bad_settings_fail_at_start(checkpoint, tmp_path: Path) -> None:
    path, _ = checkpoint
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(DiskTierError, match="not usable"):
        engine(path, a_file)
    llm = engine(path, tmp_path / "tier")
    try:
        with pytest.raises(DiskTierError, match="in use by another"):
            engine(path, tmp_path / "tier")
    finally:
        llm.shutdown()
    with pytest.raises(DiskTierError, match="cannot hold one block"):
        engine(path, tmp_path / "tier", kv_cache_disk_bytes=1000)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        engine(path, tmp_path / "tier", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        engine(path, tmp_path / "tier", tensor_parallel_size=2)
