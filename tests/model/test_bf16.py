"""bf16 numerics on CPU, every family: logits as close to the fp32 truth as transformers' own bf16
run is, and greedy tokens equal to tokenmill's fp32 reference where the fp32 margins are clear.

These run the bf16 paths the engine picks on CPU (the "cpu" attention backend when the C++
kernels build: bf16 paged KV cache, decode kernel reading it) on any CPU; bf16 hardware only
makes them faster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_checkpoint, save_tiny_model
from tokenmill import LLM, CompletionOutput, SamplingParams
from tokenmill.cache.storage import KVStorage, ReqToTokenPool
from tokenmill.cache.view_builder import make_prefill_view
from tokenmill.config import EngineConfig
from tokenmill.model.loader import load_model

FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": {},
    "qwen3": dict(head_dim=32),
    "phi3": dict(partial_rotary_factor=0.75),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=8, sliding_window_pattern=2),
}
GREEDY_TOKENS = 8
GREEDY_VOCAB = 24  # few competitors: wider top-2 margins
MIN_MARGIN = 0.1  # nats between the fp32 top-2 tokens: 4x the tiny models' bf16 logit error (~0.025)


def bf16_prefill_logits(path: Path, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill logits of every prompt token, as the engine computes them in bf16 on CPU."""
    model = load_model(path, torch.bfloat16, "cpu")
    cfg = model.config
    model.backend = model.make_backend(EngineConfig(device="cpu"), torch.bfloat16)
    storage = KVStorage(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    pool = ReqToTokenPool(len(prompts), 128, "cpu")
    rows = [pool.alloc() for _ in prompts]
    loc, start = [], 1
    for row, prompt in zip(rows, prompts):
        slots = torch.arange(start, start + len(prompt))
        pool.write(row, 0, slots)
        loc.append(slots)
        start += len(prompt)
    lens = [len(p) for p in prompts]
    view = make_prefill_view(storage, pool.table, rows, [0] * len(prompts), lens, torch.cat(loc))
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    return model(ids, positions, view).float()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(kind: str, tmp_path: Path) -> None:
    hf_model = save_tiny_checkpoint(tmp_path, kind, **FAMILIES[kind])
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in (7, 40)]
    ours = bf16_prefill_logits(tmp_path, prompts)
    with torch.no_grad():
        truth = torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts])
        hf_bf16 = hf_model.to(torch.bfloat16)
        theirs = torch.cat([hf_bf16(torch.tensor([p])).logits[0].float() for p in prompts])
    their_error = (theirs - truth).abs().max().item()
    our_error = (ours - truth).abs().max().item()
    assert their_error > 0, "the reference run was not in bf16"
    assert our_error <= 2 * their_error + 1e-2, f"bf16 error {our_error:.4f} vs transformers' {their_error:.4f}"


def greedy(path: Path, dtype: str, prompts: list[list[int]]) -> list[CompletionOutput]:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(model=str(path), dtype=dtype, device="cpu", num_kv_slots=4096, skip_tokenizer_init=True)
    try:
        assert llm.engine.worker.storage.k_buffer.dtype == getattr(torch, dtype)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def candidate_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    lengths = (5, 9, 14, 20, 27, 33, 41, 50) * 6
    return [torch.randint(3, GREEDY_VOCAB, (n,), generator=gen).tolist() for n in lengths]


def min_margin(output: CompletionOutput) -> float:
    """Smallest gap, in nats, between the chosen (greedy) token and the runner-up over the output."""
    return min(
        entry[token].logprob - max(lp.logprob for t, lp in entry.items() if t != token)
        for token, entry in zip(output.token_ids, output.logprobs)
    )


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_bf16_greedy_tokens_equal_the_fp32_reference(kind: str, tmp_path: Path) -> None:
    """Prompts are kept when the fp32 run's top-2 margins stay above MIN_MARGIN for all
    GREEDY_TOKENS steps (chosen from the fp32 reference alone); bf16 must then agree on every token."""
    save_tiny_model(tmp_path, kind, vocab_size=GREEDY_VOCAB, **FAMILIES[kind])
    candidates = candidate_prompts()
    reference = greedy(tmp_path, "float32", candidates)
    clear = [i for i, out in enumerate(reference) if min_margin(out) >= MIN_MARGIN]
    assert len(clear) >= 4, "too few prompts with clear margins for a meaningful check"
    ours = greedy(tmp_path, "bfloat16", [candidates[i] for i in clear])
    assert [o.token_ids for o in ours] == [reference[i].token_ids for i in clear]


@pytest.mark.parametrize(("dtype", "kv_dtype"), [("bfloat16", "float32"), ("float32", "bfloat16")])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_kv_cache_in_another_dtype(tmp_path: Path, dtype: str, kv_dtype: str, backend: str) -> None:
    """``kv_cache_dtype``: keys and values stored in the cache's dtype and read back converted; greedy
    tokens equal the fp32 reference where its margins are clear (as above)."""
    save_tiny_model(tmp_path, "llama", vocab_size=GREEDY_VOCAB)
    candidates = candidate_prompts()
    reference = greedy(tmp_path, "float32", candidates)
    clear = [i for i, out in enumerate(reference) if min_margin(out) >= MIN_MARGIN]
    assert len(clear) >= 4, "too few prompts with clear margins for a meaningful check"
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", num_kv_slots=4096, skip_tokenizer_init=True, attention_backend=backend)
    llm = LLM(model=str(tmp_path), dtype=dtype, kv_cache_dtype=kv_dtype, **options)
    try:
        assert llm.engine.worker.storage.k_buffer.dtype == getattr(torch, kv_dtype)
        fused = llm.engine.worker.cpu_decode  # the C++ decode forward: a cache in the model's dtype only
        assert fused is None or not fused.can_run(1)
        ours = llm.generate([candidates[i] for i in clear], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in ours] == [reference[i].token_ids for i in clear]
