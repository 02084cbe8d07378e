"""LoRA adapters through the engine against PEFT's merged models (``merge_and_unload``: the oracle):
fp32 prompt logprobs to 1e-4 and greedy tokens for every family with adaptable projections, mixed
batches equal to each request alone (with more adapters than slots), a quantized base, prefix
caching keyed by adapter version, live updates, unloading and every refusal."""

from __future__ import annotations

import gc
import queue
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.tiny_models import make_hf_model, save_tiny_checkpoint
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.model.lora import LoRAError
from tokenmill.model.quantization import fake_quantize_model
from tokenmill.request import ParameterError, RequestOutput, accumulate

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 33, 2, 60, 61, 8, 91, 44, 12], list(range(3, 30)), [7, 7, 8]]
NEW_TOKENS = 10

FAMILIES = {
    "llama": ("llama", {}, ALL_PROJECTIONS),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True), ALL_PROJECTIONS),
    "mistral_window": ("mistral", dict(sliding_window=8), ALL_PROJECTIONS),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False), ALL_PROJECTIONS),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False), ALL_PROJECTIONS),
    "phi3_fused": ("phi3", {}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8), ALL_PROJECTIONS),
    "gemma3": ("gemma3", dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=8), ALL_PROJECTIONS),
    "qwen3_moe_attention": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40),
        ["q_proj", "k_proj", "v_proj", "o_proj"],
    ),
}
"""Family case -> (kind, config overrides, PEFT target modules)."""


def save_adapter(
    base: torch.nn.Module, path: Path, seed: int, targets: list[str], rank: int = 8, **config: Any
) -> torch.nn.Module:
    """A PEFT adapter with random (nonzero) A and B on ``base`` saved to ``path``; returns the
    merged model (the oracle). ``base`` is consumed."""
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, **config)
    peft_model = get_peft_model(base, lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.15)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ``n`` tokens, end-of-sequence ignored (as
    the engine's requests here ignore it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """transformers' fp32 log-probabilities of ``prompt[1:]``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def ours(output) -> torch.Tensor:
    return torch.tensor([entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])])


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_adapter_equals_peft_merged_model(case: str, tmp_path: Path) -> None:
    kind, overrides, targets = FAMILIES[case]
    save_tiny_checkpoint(tmp_path / "base", kind, **overrides)
    merged = save_adapter(make_hf_model(kind, **overrides), tmp_path / "adapter", 1, targets)
    llm = LLM(
        model=str(tmp_path / "base"),
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        lora_modules=[f"tuned={tmp_path / 'adapter'}"],
        max_num_batched_tokens=16,  # the 27-token prompt is chunked
    )
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("tuned"))
        for prompt, output in zip(PROMPTS, outputs):
            torch.testing.assert_close(ours(output), prompt_logprobs(merged, prompt), atol=1e-4, rtol=0)
            assert output.outputs[0].token_ids == hf_greedy(merged, prompt, NEW_TOKENS)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def three_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str | None, torch.nn.Module]]:
    """A tiny Llama and three adapters of different ranks and targets (one rsLoRA); oracles by name
    (None: the base model)."""
    root = tmp_path_factory.mktemp("lora")
    oracles: dict[str | None, torch.nn.Module] = {None: save_tiny_checkpoint(root / "base", "llama")}
    oracles["a"] = save_adapter(make_hf_model("llama"), root / "a", 1, ALL_PROJECTIONS, rank=8)
    oracles["b"] = save_adapter(make_hf_model("llama"), root / "b", 2, ["q_proj", "v_proj"], rank=4)
    oracles["c"] = save_adapter(make_hf_model("llama"), root / "c", 3, ["o_proj", "down_proj"], rank=2, use_rslora=True)
    return root, oracles


def lora_llm(root: Path, **options: Any) -> LLM:
    settings: dict[str, Any] = dict(
        model=str(root / "base"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_slots=1024
    )
    settings |= options
    return LLM(**settings)


def test_mixed_batch_with_more_adapters_than_slots_equals_each_request_alone(three_adapters) -> None:
    """Four kinds of request (base, a, b, c) in one batch on two slots: the third adapter waits for a
    slot (the least recently used one no running request holds), every output equals its oracle."""
    root, oracles = three_adapters
    llm = lora_llm(root, lora_modules={name: str(root / name) for name in "abc"})
    try:
        names = [None, "a", "b", "c", "a", None, "c", "b"]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        requests = [None if n is None else LoRARequest(n) for n in names]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
        for name, prompt, output in zip(names, prompts, outputs):
            assert output.outputs[0].token_ids == hf_greedy(oracles[name], prompt, NEW_TOKENS), name
            torch.testing.assert_close(ours(output), prompt_logprobs(oracles[name], prompt), atol=1e-4, rtol=0)
        stats = llm.engine.stats()["lora"]
        assert stats["slots"] == 2 and stats["loaded"] == 3 and stats["slot_loads"] >= 3  # an eviction happened
    finally:
        llm.shutdown()


def test_siblings_preemption_and_speculation_keep_the_adapter(three_adapters) -> None:
    """n=2 forks, preemption (a pool too small for every sequence) and n-gram verification rows all
    compute with the sequence's adapter."""
    root, oracles = three_adapters
    llm = lora_llm(
        root,
        lora_modules={"a": str(root / "a")},
        num_kv_slots=96,
        page_size=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8},
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=LoRARequest("a"))
        for prompt, output in zip(PROMPTS, outputs):
            expected = hf_greedy(oracles["a"], prompt, 24)
            assert [c.token_ids for c in output.outputs] == [expected, expected]
        stats = llm.engine.stats()
        assert stats["scheduler"]["preemptions"] > 0 and stats["speculative"]["accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_prefixes_are_cached_per_adapter_version_and_updates_apply_at_once(three_adapters, tmp_path: Path) -> None:
    root, oracles = three_adapters
    llm = lora_llm(root, lora_modules={"a": str(root / "a"), "b": str(root / "b")}, page_size=4)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(name: str | None):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest(name) if name else None)[0]

    try:
        first = run("a")
        assert first.num_cached_tokens == 0 and first.outputs[0].lora_versions == [1] * 4
        assert run("a").num_cached_tokens == 36  # the adapter's own prefix
        assert run("b").num_cached_tokens == 0  # not a's KV
        base = run(None)
        assert base.num_cached_tokens == 0 and base.outputs[0].lora_versions == []  # nor the base model's
        # an update: another adapter's matrices under the name "a" (PEFT names, as saved)
        updated = save_adapter(make_hf_model("llama"), tmp_path / "a2", 9, ALL_PROJECTIONS, rank=8)
        from safetensors.torch import load_file

        version = llm.update_lora("a", load_file(str(tmp_path / "a2" / "adapter_model.safetensors")))
        assert version == 2
        after = run("a")
        assert after.num_cached_tokens == 0  # the old version's prefixes are never matched again
        assert after.outputs[0].token_ids == hf_greedy(updated, prompt, 4)
        assert after.outputs[0].lora_versions == [2] * 4
        assert run("a").num_cached_tokens == 36
    finally:
        llm.shutdown()


def test_an_update_reaches_running_requests_and_tags_their_tokens(three_adapters, tmp_path: Path) -> None:
    """A request running across an update goes on (with the new matrices, over the KV it holds,
    as with weight updates): its tokens before the update carry version 1 and are the old adapter's,
    those after it carry version 2."""
    root, oracles = three_adapters
    llm = lora_llm(root, lora_modules={"a": str(root / "a")})
    save_adapter(make_hf_model("llama"), tmp_path / "a2", 9, ALL_PROJECTIONS, rank=8)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "a2" / "adapter_model.safetensors"))
    deltas: queue.Queue[RequestOutput] = queue.Queue()
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    try:
        llm.engine.add_request(PROMPTS[2], params, deltas.put, None, None, "a")
        total = deltas.get(timeout=60)
        assert llm.update_lora("a", tensors) == 2
        while not total.finished:
            total = accumulate(total, deltas.get(timeout=60))
        out = total.outputs[0]
        switch = out.lora_versions.index(2)
        assert 0 < switch and out.lora_versions == [1] * switch + [2] * (240 - switch)
        assert out.token_ids[:switch] == hf_greedy(oracles["a"], PROMPTS[2], switch)
        assert llm.engine.lora.version("a") == 2
    finally:
        llm.shutdown()


def test_bad_updates_change_nothing(three_adapters) -> None:
    root, oracles = three_adapters
    llm = lora_llm(root, lora_modules={"b": str(root / "b")})
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    try:
        with pytest.raises(LoRAError, match="non-finite"):
            llm.update_lora("b", {key: torch.full((4, 64), float("nan"))})
        with pytest.raises(LoRAError, match=r"lora_A \(5, 64\)"):
            llm.update_lora("b", {key: torch.zeros(5, 64)})
        with pytest.raises(LoRAError, match="does not hold"):
            llm.update_lora("b", {key.replace("q_proj", "k_proj"): torch.zeros(4, 64)})
        with pytest.raises(KeyError):
            llm.update_lora("nope", {key: torch.zeros(4, 64)})
        output = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("b"))[0]
        assert output.outputs[0].token_ids == hf_greedy(oracles["b"], PROMPTS[0], NEW_TOKENS)
    finally:
        llm.shutdown()


def test_load_on_first_use_unload_frees_the_adapter_and_unknown_names_are_refused(three_adapters) -> None:
    root, oracles = three_adapters
    llm = lora_llm(root)
    try:
        request = LoRARequest("c", 1, str(root / "c"))  # loaded by generate: vLLM's way
        output = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=request)[0]
        assert output.outputs[0].token_ids == hf_greedy(oracles["c"], PROMPTS[1], NEW_TOKENS)
        assert llm.list_loras() == ["c"]
        matrices = [weakref.ref(d.a) for d in llm.engine.lora_adapters()["c"].deltas.values()]
        slots = llm.engine.worker.lora
        assert any(w.b.abs().sum() > 0 for w in slots.weights.values())
        llm.unload_lora("c")
        gc.collect()
        assert llm.list_loras() == [] and all(ref() is None for ref in matrices)  # its matrices are freed
        assert all(w.a.abs().sum() == 0 and w.b.abs().sum() == 0 for w in slots.weights.values())  # slot emptied
        with pytest.raises(ParameterError, match=r"lora_request names no loaded adapter: 'c'"):
            llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("c"))
        with pytest.raises(KeyError):
            llm.unload_lora("c")
        base = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]  # the base model is untouched
        assert base.outputs[0].token_ids == hf_greedy(oracles[None], PROMPTS[1], NEW_TOKENS)
    finally:
        llm.shutdown()


def test_unloading_an_adapter_in_use_is_refused(three_adapters) -> None:
    root, _ = three_adapters
    llm = lora_llm(root, lora_modules={"a": str(root / "a")})
    try:
        states = []
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # admitted before the unload runs
        state = llm.engine.intake(PROMPTS[0], params, lambda delta: states.append(delta), None, None, "a")
        llm.engine.submit(state)
        with pytest.raises(ValueError, match="in use by 1 unfinished request"):
            llm.unload_lora("a")
        llm.engine.abort(state.request_id)
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("exact_fp32_activations")
def test_quantized_base_with_an_adapter_equals_peft_on_the_dequantized_weights(three_adapters) -> None:
    """The base quantized int8 at load, the adapter's matrices in full precision: the oracle is PEFT's
    unmerged model on the fake-quantized base (the delta is not quantized)."""
    root, _ = three_adapters
    llm = lora_llm(root, lora_modules={"a": str(root / "a")}, quantization="int8")
    base = make_hf_model("llama")
    fake_quantize_model(base, QuantScheme(8))
    oracle = PeftModel.from_pretrained(base, str(root / "a")).eval()
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("a"))
        for prompt, output in zip(PROMPTS, outputs):
            assert output.outputs[0].token_ids == hf_greedy(oracle, prompt, NEW_TOKENS)
            torch.testing.assert_close(ours(output), prompt_logprobs(oracle, prompt), atol=1e-4, rtol=0)
    finally:
        llm.shutdown()


def test_tensor_parallel_adapters_equal_peft(three_adapters, tmp_path: Path) -> None:
    """tp=2: each rank holds its part of every adapter (B's rows of q/k/v and gate/up blocks, A's
    columns of o/down inputs); one slot for three adapters makes slot loads reach the worker between
    steps, and an update too."""
    root, oracles = three_adapters
    llm = lora_llm(root, lora_modules={name: str(root / name) for name in "abc"}, max_loras=1, tensor_parallel_size=2)
    try:
        names = ["a", None, "b", "c"]
        requests = [None if n is None else LoRARequest(n) for n in names]
        outputs = llm.generate([PROMPTS[0]] * 4, GREEDY, use_tqdm=False, lora_request=requests)
        for name, output in zip(names, outputs):
            assert output.outputs[0].token_ids == hf_greedy(oracles[name], PROMPTS[0], NEW_TOKENS), name
            torch.testing.assert_close(ours(output), prompt_logprobs(oracles[name], PROMPTS[0]), atol=1e-4, rtol=0)
        updated = save_adapter(make_hf_model("llama"), tmp_path / "b2", 7, ["q_proj", "v_proj"], rank=4)
        from safetensors.torch import load_file

        llm.update_lora("b", load_file(str(tmp_path / "b2" / "adapter_model.safetensors")))
        output = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("b"))[0]
        assert output.outputs[0].token_ids == hf_greedy(updated, PROMPTS[1], NEW_TOKENS)
    finally:
        llm.shutdown()


def test_adapters_that_do_not_fit_are_refused_naming_the_problem(three_adapters, tmp_path: Path) -> None:
    root, _ = three_adapters
    save_adapter(make_hf_model("llama"), tmp_path / "rank16", 1, ["q_proj"], rank=16)
    save_adapter(make_hf_model("llama"), tmp_path / "head", 1, ["lm_head"], rank=4)
    save_adapter(make_hf_model("llama", hidden_size=32), tmp_path / "other", 1, ["q_proj"], rank=4)
    save_adapter(make_hf_model("llama"), tmp_path / "dora", 1, ["q_proj"], rank=4, use_dora=True)
    llm = lora_llm(root)
    try:
        cases = {
            "rank16": r"rank 16, above max_lora_rank 8",
            "head": r"lm_head",  # PEFT saves the head's full weights too: an unexpected tensor
            "other": r"lora_A \(4, 32\) .* needs lora_A \(4, 64\)",
            "dora": r"DoRA adapters are not supported",
        }
        for name, message in cases.items():
            with pytest.raises(LoRAError, match=message):
                llm.load_lora(name, str(tmp_path / name))
        with pytest.raises(LoRAError, match="has no adapter_config.json"):
            llm.load_lora("missing", str(tmp_path))
        llm.load_lora("a", str(root / "a"))
        with pytest.raises(ValueError, match="already loaded"):
            llm.load_lora("a", str(root / "a"))
        assert llm.list_loras() == ["a"]
    finally:
        llm.shutdown()


def test_lora_settings_are_checked_at_start(three_adapters) -> None:
    root, _ = three_adapters
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(model=str(root / "base"), lora_modules=[f"a={root / 'a'}"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        LLM(model=str(root / "base"), enable_lora=True, lora_modules=["no-path"])
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(model=str(root / "base"), enable_lora=True, max_lora_rank=0)
    llm = LLM(model=str(root / "base"), dtype="float32")
    try:
        with pytest.raises(ParameterError, match="lora_request needs an engine started with enable_lora"):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a"))
        with pytest.raises(ValueError, match="enable_lora"):
            llm.load_lora("a", str(root / "a"))
    finally:
        llm.shutdown()
