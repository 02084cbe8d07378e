"""The KV host tier through the engine: prefixes the device evicted come back from host memory with
outputs equal to a run without the tier, in front of the disk tier a restart reads disk once and
memory after, a weight update leaves nothing stale, and bad settings fail at start."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SMALL_POOL = dict(num_kv_slots=512, max_num_batched_tokens=96, page_size=4)
HOST_BYTES = 64 * 1024**2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("host-tier-llama")
    hf_model = save_tiny_checkpoint(path, "llama", max_position_embeddings=1024)
    hf_model.generation_config.eos_token_id = None
    return path, hf_model


def cycling_batch() -> list[list[int]]:
    """Eight 200-token prefixes, three requests each, in turn: a 512-slot pool evicts each before its repeat."""
    rng = random.Random(1)
    shared = [[rng.randrange(4, 97) for _ in range(200)] for _ in range(8)]
    return [shared[i % 8] + [4 + i] for i in range(24)]


def run(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], int]]:
    outputs = llm.generate(batch, [GREEDY] * len(batch), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]


def run_engine(model: Path, batch: list[list[int]], **options: object) -> tuple[list, dict]:
    """``batch`` run by a fresh engine that then shuts down: results and engine stats."""
    llm = LLM(dtype="float32", model=str(model), **options)
    try:
        return run(llm, batch), llm.engine.stats()
    finally:
        llm.shutdown()


def test_evicted_prefixes_come_back_from_host_memory(checkpoint) -> None:
    path, hf_model = checkpoint
    batch = cycling_batch()
    expected, plain = run_engine(path, batch, **SMALL_POOL)
    got, stats = run_engine(path, batch, kv_cache_host_bytes=HOST_BYTES, **SMALL_POOL)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert got[0][0] == hf_greedy(hf_model, batch[0], 8)
    host = stats["host_tier"]
    assert host["hit_tokens"] == 16 * 192, host  # every repeat's 3 whole blocks, from memory
    assert host["blocks"] > 0 and stats["disk_tier"] is None
    assert sum(cached for _, cached in got) - sum(cached for _, cached in expected) >= 16 * 192 - 100
    assert plain["host_tier"] is None


def block_bytes(model: Path) -> int:
    """Bytes of one block: keys and values of 64 tokens over every layer, fp32."""
    config = json.loads((model / "config.json").read_text())
    return 2 * config["num_hidden_layers"] * 64 * config["num_key_value_heads"] * config["head_dim"] * 4


def test_a_budget_of_one_block_serves_only_the_most_recent(checkpoint) -> None:
    path, _ = checkpoint
    batch = cycling_batch()
    expected, _ = run_engine(path, batch, **SMALL_POOL)
    got, stats = run_engine(path, batch, kv_cache_host_bytes=block_bytes(path), **SMALL_POOL)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    host = stats["host_tier"]
    assert host["blocks"] == 1 and host["bytes"] == block_bytes(path) and host["evicted_blocks"] > 0
    assert host["hit_tokens"] < 16 * 192


def test_in_front_of_disk_a_restart_reads_disk_once_then_memory(checkpoint, tmp_path: Path) -> None:
    path, _ = checkpoint
    batch = cycling_batch()
    both = dict(kv_cache_host_bytes=HOST_BYTES, kv_cache_disk_dir=str(tmp_path), **SMALL_POOL)
    first, _ = run_engine(path, batch, **both)
    second, stats = run_engine(path, batch, **both)
    assert [tokens for tokens, _ in second] == [tokens for tokens, _ in first]
    assert [cached for _, cached in second] == [192] * 24  # every request's 3 whole blocks from a tier
    host, disk = stats["host_tier"], stats["disk_tier"]
    assert stats["cache"]["prefix_hit_tokens"] == 0  # the pool evicts every prefix before its repeat
    assert disk["read_bytes"] == 24 * block_bytes(path)  # each of the 24 blocks read from disk once ...
    assert host["hit_tokens"] >= 16 * 192 and disk["hit_tokens"] >= 192  # ... and its repeats from memory
    assert host["hit_tokens"] + disk["hit_tokens"] == 24 * 192
    assert host["query_tokens"] == disk["query_tokens"] == stats["cache"]["prefix_query_tokens"]


def test_a_weight_update_leaves_nothing_stale(checkpoint) -> None:
    path, hf_model = checkpoint
    batch = cycling_batch()[:9]  # prefix 0 again at the end, after the pool evicted it
    llm = LLM(dtype="float32", model=str(path), kv_cache_host_bytes=HOST_BYTES, **SMALL_POOL)
    try:
        run(llm, batch)
        assert llm.engine.stats()["host_tier"]["blocks"] > 0
        name = "model.layers.0.mlp.down_proj.weight"
        new = dict(hf_model.named_parameters())[name].detach() + 0.5
        llm.update_weights([(name, new)])
        assert llm.engine.stats()["host_tier"]["blocks"] == 0
        ((tokens, cached),) = run(llm, batch[-1:])
        assert cached == 0
    finally:
        llm.shutdown()
    with torch.no_grad():
        dict(hf_model.named_parameters())[name].copy_(new)
    try:
        assert tokens == hf_greedy(hf_model, batch[-1], 8)
    finally:
        with torch.no_grad():
            dict(hf_model.named_parameters())[name].sub_(0.5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(kv_cache_host_bytes=-1), "kv_cache_host_bytes must be >= 0"),
        (dict(kv_cache_host_bytes=HOST_BYTES, enable_prefix_caching=False), "needs enable_prefix_caching"),
        (dict(kv_cache_host_bytes=1000), "cannot hold one block"),
    ],
)
def test_bad_settings_fail_at_start(checkpoint, options: dict, message: str) -> None:
    path, _ = checkpoint
    with pytest.raises(ValueError, match=message):
        LLM(dtype="float32", model=str(path), **options)
