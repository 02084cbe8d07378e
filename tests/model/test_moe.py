"""Mixture-of-experts families (Mixtral, Qwen3-MoE) through the engine, against transformers:
greedy tokens under chunked prefill, preemption and prefix-cache hits on the CPU and torch
backends; weight updates of one expert by its checkpoint name; the expert computation batched by
expert, and the same once unstacked into per-expert layers; config errors named."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.tiny_models import hf_greedy, save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.model.config import ModelConfigError
from tokenmill.model.moe import ExpertNames, Experts
from tokenmill.model.registry import load_model_config

NEW_TOKENS = 24
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True),
}
EXPERT_GATE = {"mixtral": "block_sparse_moe.experts.1.w1.weight", "qwen3_moe": "mlp.experts.1.gate_proj.weight"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    hf_model = save_tiny_checkpoint(path, kind, **FAMILIES[kind])
    hf_model.generation_config.eos_token_id = None
    return kind, path, hf_model


def prompts_with_shared_prefix(n: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(4, 97) for _ in range(16)]
    return [prefix + [rng.randrange(4, 97) for _ in range(rng.randint(3, 30))] for _ in range(n)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_engine_matches_transformers_under_chunking_preemption_and_prefix_hits(family, backend: str) -> None:
    kind, path, hf_model = family
    prompts = prompts_with_shared_prefix(6)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(
        model=str(path),
        dtype="float32",
        attention_backend=backend,
        num_kv_slots=160,  # less than the six requests need at once: preemption
        page_size=4,
        max_num_batched_tokens=24,  # prompts of 19-46 tokens: chunked prefill
    )
    try:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params, use_tqdm=False)]
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats["scheduler"]["preemptions"] > 0
    assert stats["cache"]["prefix_hit_tokens"] > 0
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    assert first == expected
    assert again == expected[:2]


def test_updating_one_expert_matches_transformers_with_the_same_update(family) -> None:
    """An expert's projection updated by its checkpoint name lands in that expert's slice only: the
    engine's greedy tokens then equal transformers' with the same tensor in the same place."""
    kind, path, hf_model = family
    layer_prefix = "model.layers.0."
    name = layer_prefix + EXPERT_GATE[kind]
    expert_param = hf_model.model.layers[0].mlp.experts.gate_up_proj  # transformers stacks them too
    intermediate = expert_param.shape[1] // 2
    update = torch.randn(intermediate, expert_param.shape[2], generator=torch.Generator().manual_seed(5)) * 0.5
    prompts = prompts_with_shared_prefix(3)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", num_kv_slots=512)
    try:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.update_weights([(name, update)])
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    original = expert_param.data[1, :intermediate].clone()
    try:
        expert_param.data[1, :intermediate] = update
        expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    finally:
        expert_param.data[1, :intermediate] = original
    assert after == expected
    assert after != before  # the update reached a routed expert


def test_experts_are_computed_per_expert_not_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """One gate/up and one down product per expert that received tokens, whatever the token count;
    the result equals the per-token definition."""
    torch.manual_seed(0)
    experts = Experts(num_experts=5, hidden=8, intermediate=6, names=ExpertNames("g", "u", "d"))
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x = torch.randn(40, 8)
    expert_ids = torch.randint(0, 4, (40, 2))  # expert 4 gets no token
    weights = torch.rand(40, 2)
    from tokenmill.model import moe

    calls = []
    monkeypatch.setattr(
        moe, "blocked_linear", lambda a, w, b, c: calls.append(a.shape[0]) or torch.nn.functional.linear(a, w)
    )
    out = experts(x, expert_ids, weights)
    used = sorted(set(expert_ids.flatten().tolist()))
    assert len(calls) == 2 * len(used) and sum(calls) == 2 * expert_ids.numel()
    expected = torch.zeros_like(x)
    for t in range(40):
        for k in range(2):
            e = expert_ids[t, k]
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weights[t, k] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(out, expected, atol=1e-5)


def test_unstacked_experts_load_by_the_same_names_and_compute_the_same() -> None:
    """Unstacked, each expert's projections are layers holding its slices of the stacks, listed
    under the same checkpoint names; the output is unchanged."""
    torch.manual_seed(0)
    experts = Experts(num_experts=5, hidden=8, intermediate=6, names=ExpertNames("g", "u", "d"))
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x, expert_ids, weights = torch.randn(40, 8), torch.randint(0, 5, (40, 2)), torch.rand(40, 2)
    stacked = experts(x, expert_ids, weights)
    before = {name: param[index].clone() for name, param, index, _ in experts.checkpoint_shards()}
    experts.unstack_()
    after = {name: param[index] for name, param, index, _ in experts.checkpoint_shards()}
    assert not hasattr(experts, "gate_up_proj") and len(experts.layers) == 5
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    torch.testing.assert_close(experts(x, expert_ids, weights), stacked)


@pytest.mark.parametrize(
    "kind, change, field",
    [
        ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok"),
        ("mixtral", dict(num_local_experts=0), "num_local_experts"),
        ("qwen3_moe", dict(moe_intermediate_size=None), "moe_intermediate_size"),
        ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ],
)
def test_bad_moe_configs_are_named(tmp_path: Path, kind: str, change: dict, field: str) -> None:
    save_tiny_checkpoint(tmp_path, kind, **FAMILIES[kind])
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw.update(change)
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=field):
        load_model_config(tmp_path)
