"""Exact parity with transformers for every supported architecture and RoPE variant.

Prefill logits must agree to 1e-4 (fp32) and a 24-token greedy continuation, computed step by
step through the KV cache for a ragged batch of prompts (torch reference backend), must match
``transformers.generate``; so must the same prompts through the engine's default path (attention
"auto": the C++ cpu backend where it builds, and the whole-step C++ decode forward for the
families that opt in).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.storage import KVStorage, ReqToTokenPool
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.loader import load_model

NEW_TOKENS = 24

CASES = {
    "llama": ("llama", {}),
    "llama_untied_bias_mlpbias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama_tied_head_dim": ("llama", dict(tie_word_embeddings=True, head_dim=24)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    "llama_linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_dynamic": ("llama", dict(max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama3": (
        "llama",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama_yarn": (
        "llama",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "mistral": ("mistral", dict(sliding_window=None)),
    # windows far shorter than the contexts (prompts up to 30 tokens + 24 generated)
    "mistral_window": ("mistral", dict(sliding_window=8)),
    "qwen2_window_upper_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    "qwen3_window": ("qwen3", dict(use_sliding_window=True, sliding_window=7, max_window_layers=0)),
    "phi3_window": ("phi3", dict(sliding_window=6)),
    "mixtral_window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3_bias_tied": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True)),
    "phi3": ("phi3", {}),
    "phi3_partial_tied": ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True)),
    # longrope with every prompt past original_max_position_embeddings: the long factors throughout
    # (short factors, and a request crossing over, are in tests/model/test_phi3.py)
    "phi3_longrope": (
        "phi3",
        dict(
            original_max_position_embeddings=4,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [1.0 + 3.0 * i for i in range(8)],
            },
        ),
    ),
    "phi3_partial_longrope_mqa": (
        "phi3",
        dict(
            num_key_value_heads=1,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=4,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.25 * i for i in range(6)],
                "long_factor": [1.0 + 3.0 * i for i in range(6)],
            },
        ),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "mixtral_top1": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=1, tie_word_embeddings=True)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False),
    ),
    "qwen3_moe_renormalized_mixed_layers": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # Gemma: head_dim set (the config's default is 256); windows of 8 crossed by every prompt + tokens;
    # query_pre_attn_scalar != head_dim; Gemma 2 soft-caps attention scores and final logits
    "gemma2": (
        "gemma2",
        dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0),
    ),
    "gemma2_untied_no_caps_mqa": (
        "gemma2",
        dict(
            head_dim=32,
            num_hidden_layers=3,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            sliding_window=6,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        ),
    ),
    "gemma3": (
        "gemma3",
        dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=8, sliding_window_pattern=2),
    ),
    "gemma3_layer_types_linear_softcap": (
        "gemma3",
        dict(
            head_dim=32,
            num_hidden_layers=4,
            query_pre_attn_scalar=64,
            sliding_window=7,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            final_logit_softcapping=3.0,
            tie_word_embeddings=False,
        ),
    ),
}

PROMPT_LENS = [5, 17, 30]


class KVHarness:
    """Drives a model step by step through the KV cache with sequential slot assignment."""

    def __init__(self, model: CausalLM, n_slots: int = 512) -> None:
        cfg = model.config
        self.model = model
        self.storage = KVStorage(cfg.num_layers, n_slots, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        self.pool = ReqToTokenPool(8, 256, "cpu")
        model.backend = TorchNativeBackend(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale, cfg.attn_logit_softcapping
        )
        self.next_slot = 1

    def _slots(self, row: int, start: int, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        self.pool.write(row, start, slots)
        return slots

    def extend(self, rows: list[int], seqs: list[list[int]], prefix_lens: list[int]) -> torch.Tensor:
        """Compute ``seqs[i][prefix_lens[i]:]`` for each request; logits of every new token."""
        new = [s[p:] for s, p in zip(seqs, prefix_lens)]
        loc = torch.cat([self._slots(r, p, len(n)) for r, p, n in zip(rows, prefix_lens, new)])
        view = make_prefill_view(self.storage, self.pool.table, rows, prefix_lens, [len(n) for n in new], loc)
        ids = torch.tensor([t for n in new for t in n])
        pos = torch.cat([torch.arange(p, p + len(n)) for p, n in zip(prefix_lens, new)])
        return self.model(ids, pos, view)

    def decode(self, rows: list[int], last_tokens: list[int], seq_lens: list[int]) -> torch.Tensor:
        """One token per request at position ``seq_lens[i] - 1``."""
        loc = torch.cat([self._slots(r, n - 1, 1) for r, n in zip(rows, seq_lens)])
        view = make_decode_view(self.storage, self.pool.table, rows, seq_lens, loc)
        return self.model(torch.tensor(last_tokens), torch.tensor(seq_lens) - 1, view)


def greedy_through_cache(model: CausalLM, prompts: list[list[int]], chunk: int | None = None) -> tuple:
    """Prefill logits per prompt and NEW_TOKENS greedy tokens, as one ragged batch."""
    harness = KVHarness(model)
    rows = [harness.pool.alloc() for _ in prompts]
    if chunk is None:
        logits = harness.extend(rows, prompts, [0] * len(prompts))
    else:  # chunked prefill: first `chunk` tokens, then the rest on top of the cached prefix
        first = harness.extend(rows, [p[:chunk] for p in prompts], [0] * len(prompts))
        rest = harness.extend(rows, prompts, [chunk] * len(prompts))
        parts, a, b = [], 0, 0
        for p in prompts:
            parts += [first[a : a + chunk], rest[b : b + len(p) - chunk]]
            a, b = a + chunk, b + len(p) - chunk
        logits = torch.cat(parts)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    per_prompt = torch.split(logits, [len(p) for p in prompts])
    tokens = [[t] for t in logits[ends].argmax(-1).tolist()]
    for _ in range(NEW_TOKENS - 1):
        seq_lens = [len(p) + len(t) for p, t in zip(prompts, tokens)]
        step = harness.decode(rows, [t[-1] for t in tokens], seq_lens).argmax(-1).tolist()
        for out, tok in zip(tokens, step):
            out.append(tok)
    return per_prompt, tokens


def reset_dynamic_rope(hf_model) -> None:
    """transformers' dynamic NTK keeps the longest length seen across calls; start each call fresh."""
    rotary = hf_model.model.rotary_emb
    if getattr(rotary, "rope_type", "default") == "dynamic":
        rotary.inv_freq = rotary.original_inv_freq.clone()
        rotary.max_seq_len_cached = rotary.original_max_seq_len


def hf_reference(hf_model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    hf_model.generation_config.eos_token_id = None  # never stop early: compare all NEW_TOKENS
    with torch.no_grad():
        reset_dynamic_rope(hf_model)
        logits = hf_model(ids).logits[0]
        reset_dynamic_rope(hf_model)
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return logits, out[0, len(prompt) :].tolist()


def assert_counting_prompts_match(model: CausalLM, hf_model) -> None:
    """``model``'s prefill logits (to 1e-4) and greedy tokens through the cache equal transformers'
    on the prompts 3, 4, ... of each length in PROMPT_LENS."""
    prompts = [list(range(3, 3 + n)) for n in PROMPT_LENS]
    logits, tokens = greedy_through_cache(model, prompts)
    for prompt, ours, greedy in zip(prompts, logits, tokens):
        hf_logits, hf_tokens = hf_reference(hf_model, prompt)
        torch.testing.assert_close(ours, hf_logits, rtol=1e-4, atol=1e-4)
        assert greedy == hf_tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_logits_and_greedy_decode_match_transformers(case: str, tmp_path: Path) -> None:
    kind, overrides = CASES[case]
    hf_model = save_tiny_model(tmp_path, kind, **overrides)
    model = load_model(tmp_path, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    logits, tokens = greedy_through_cache(model, prompts)
    references = [hf_reference(hf_model, prompt) for prompt in prompts]
    for ours_logits, ours_tokens, (ref_logits, ref_tokens) in zip(logits, tokens, references):
        assert (ours_logits - ref_logits).abs().max().item() <= 1e-4
        assert ours_tokens == ref_tokens
    # the default path: the engine with attention "auto" (the cpu backend where its kernels build)
    # and the whole-step C++ decode forward where the family opts in
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_slots=512)
    try:
        limit = llm.engine.max_context_len
        params = [
            SamplingParams(max_tokens=min(NEW_TOKENS, limit - len(p)), temperature=0.0, ignore_eos=True)
            for p in prompts
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out, sp, (_, ref_tokens) in zip(outputs, params, references):
        assert out.outputs[0].token_ids == ref_tokens[: sp.max_tokens]


def test_chunked_prefill_over_cached_prefix_matches_one_shot(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "llama")
    model = load_model(tmp_path, torch.float32, "cpu")
    prompts = [list(range(3, 3 + n)) for n in (9, 14, 20)]
    whole_logits, whole_tokens = greedy_through_cache(model, prompts)
    chunk_logits, chunk_tokens = greedy_through_cache(model, prompts, chunk=6)
    for a, b in zip(whole_logits, chunk_logits):
        assert (a - b).abs().max().item() <= 1e-5
    assert whole_tokens == chunk_tokens


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    hf_model = save_tiny_model(tmp_path, "qwen2", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    model = load_model(tmp_path, torch.float32, "cpu")
    prompt = list(range(5, 25))
    (ours,), (tokens,) = greedy_through_cache(model, [prompt])
    ref_logits, ref_tokens = hf_reference(hf_model, prompt)
    assert (ours - ref_logits).abs().max().item() <= 1e-4
    assert tokens == ref_tokens


def test_dynamic_rope_engages_past_max_position_embeddings_through_the_engine(tmp_path: Path) -> None:
    """Dynamic NTK rescales for sequences past ``max_position_embeddings``: the engine lets a request
    run to ``factor`` times it, and its tokens there equal transformers'."""
    hf_model = save_tiny_model(
        tmp_path, "llama", max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    prompt = torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_slots=256)
    try:
        assert llm.engine.max_context_len == 48
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    hf_model.generation_config.eos_token_id = None
    reset_dynamic_rope(hf_model)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0
        )[0, 30:].tolist()
    assert out[0].outputs[0].token_ids == expected
