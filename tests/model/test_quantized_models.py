"""Quantized models against transformers: the same model with every quantized weight replaced by its
dequantized value, run in fp32, is the oracle (the quantization error itself is measured in the
README, not hidden here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.test_parity import PROMPT_LENS, assert_counting_prompts_match, greedy_through_cache, hf_reference
from tests.tiny_models import hf_greedy, save_tiny_checkpoint, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.kernels.quant_linear import int8_dot_products
from tokenmill.model import quantization
from tokenmill.model.loader import load_model
from tokenmill.model.moe import Experts
from tokenmill.model.quantization import (
    INT4_DEFAULT_GROUP,
    LM_HEAD_SCHEME,
    fake_quantize_model,
    quantize_model,
    set_activation_passes,
)
from tokenmill.model.weights import WeightError

CASES = {
    "llama": ("llama", {}),
    "qwen2_bias_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "phi3": ("phi3", {}),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0)),
}
SCHEMES = {"int8": QuantScheme(8), "int4": QuantScheme(4, None, symmetric=False), "int4-sym-g32": QuantScheme(4, 32)}


@pytest.mark.usefixtures("exact_fp32_activations")
@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_model_matches_transformers_on_the_dequantized_weights(case, scheme_name, tmp_path: Path) -> None:
    kind, overrides = CASES[case]
    scheme = SCHEMES[scheme_name]
    hf_model = save_tiny_model(tmp_path, kind, **overrides)
    model = load_model(tmp_path, torch.float32, "cpu")
    n_quantized = quantize_model(model, scheme)
    assert n_quantized > 0 and model.quantization == scheme
    stacks = [m for m in model.modules() if isinstance(m, Experts)]
    assert all(layer.quantization == scheme for m in stacks for pair in m.layers for layer in pair)  # MoE experts too
    assert model.lm_head.quantization == LM_HEAD_SCHEME  # int8 whatever the scheme, tied to the embeddings or not
    if hf_model.config.tie_word_embeddings:  # the table itself stays for the lookups
        assert torch.equal(model.model.embed_tokens.weight, hf_model.get_input_embeddings().weight)
    fake_quantize_model(hf_model, scheme)
    assert_counting_prompts_match(model, hf_model)


@pytest.mark.skipif(not int8_dot_products(), reason="needs AVX2 or AVX512-VNNI (the panels layout's int8 kernel)")
@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
@pytest.mark.parametrize("passes", [2, 1])
def test_fp32_panels_model_matches_transformers_with_its_activations_quantized(
    scheme_name, passes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 in the panels layout (the default where the int8 path is the AVX2 one; taken here on any
    CPU with an int8 path, whose kernel takes fp32 input too), activations in two int8 passes or
    one: the oracle is transformers in fp32 on the dequantized weights with each projection's input
    quantized as the kernel does; greedy tokens equal, logits to 1e-3 (not 1e-4: an input that fp32
    summation order moves across a rounding boundary of its last int8 pass moves by that pass's
    step, which the layers after it amplify; with one pass that step is 254 times as large, and the
    logits are held to 1% of their largest magnitude)."""
    monkeypatch.setattr(quantization, "panels_on_cpu", lambda dtype: True)
    scheme = SCHEMES[scheme_name]
    hf_model = save_tiny_model(tmp_path, "llama")
    model = load_model(tmp_path, torch.float32, "cpu")
    quantize_model(model, scheme)
    assert set_activation_passes(model, passes) > 0
    assert all(m.qweight.dim() == 3 for m in model.model.layers.modules() if getattr(m, "quantization", None))
    fake_quantize_model(hf_model, scheme, int8_activations=True, activation_passes=passes)
    prompts = [list(range(3, 3 + n)) for n in PROMPT_LENS]
    for prompt, ours, greedy in zip(prompts, *greedy_through_cache(model, prompts)):
        theirs, their_greedy = hf_reference(hf_model, prompt)
        tolerance = 1e-3 if passes == 2 else 1e-2 * theirs.abs().max().item()
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=tolerance)
        assert greedy == their_greedy


@pytest.mark.skipif(not int8_dot_products(), reason="needs AVX2 or AVX512-VNNI (the panels layout's int8 kernel)")
def test_engine_with_int8_activations_generates_what_transformers_does_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LLM(quantized_activations="int8")``: every quantized projection, and the fused C++ decode
    forward that runs the decode steps, quantizes its input in one int8 pass; the greedy tokens are
    transformers' on the dequantized weights with inputs so quantized."""
    monkeypatch.setattr(quantization, "panels_on_cpu", lambda dtype: True)
    hf_model = save_tiny_checkpoint(tmp_path)
    scheme = QuantScheme(4, INT4_DEFAULT_GROUP, symmetric=False)  # the engine's "int4"
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        quantization="int4",
        quantized_activations="int8",
        max_num_batched_tokens=16,
    )
    worker = llm.engine.worker
    model = worker.model
    quantized = [m for m in model.modules() if getattr(m, "quantization", None) is not None and m is not model]
    assert quantized and all(m.activation_passes == 1 for m in quantized)
    layers = set(model.model.layers.modules())  # (the head's width is no multiple of 16: rows layout)
    assert all(m.qweight.dim() == 3 for m in quantized if m in layers)
    assert worker.cpu_decode is not None and worker.cpu_decode.activation_passes == 1
    fake_quantize_model(hf_model, scheme, int8_activations=True, activation_passes=1)
    prompts = [[5, 6, 7], list(range(3, 30))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 12) for p in prompts]


@pytest.mark.skipif(not int8_dot_products(), reason="needs AVX2 or AVX512-VNNI (the panels layout's int8 kernel)")
@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_bf16_panels_model_is_as_close_to_its_fp32_oracle_as_transformers_bf16(scheme_name, tmp_path: Path) -> None:
    """A bf16 model on a CPU with the int8 kernel keeps its projections in the panels layout (int8 activations): the
    oracle is transformers in fp32 on the dequantized weights with each projection's input quantized
    the same way; our bf16 error must be within what transformers' own bf16 run makes. Both quantize
    the checkpoint's weights as rounded to bf16 (what the bf16 model loads)."""
    scheme = SCHEMES[scheme_name]
    hf_model = save_tiny_model(tmp_path, "llama").to(torch.bfloat16).float()
    model = load_model(tmp_path, torch.bfloat16, "cpu")
    quantize_model(model, scheme)
    layers = model.model.layers.modules()
    assert all(m.qweight.dim() == 3 for m in layers if getattr(m, "quantization", None))  # widths multiples of 16
    fake_quantize_model(hf_model, scheme, int8_activations=True)
    prompts = [list(range(3, 3 + n)) for n in PROMPT_LENS]
    logits, _ = greedy_through_cache(model, prompts)
    for prompt, ours in zip(prompts, logits):
        truth, _ = hf_reference(hf_model, prompt)
        theirs, _ = hf_reference(hf_model.to(torch.bfloat16), prompt)
        hf_model.float()
        their_error, our_error = (theirs.float() - truth).abs().max(), (ours.float() - truth).abs().max()
        assert 0 < their_error and our_error <= 2 * their_error + 1e-2, (our_error, their_error)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_generates_what_transformers_does_with_the_dequantized_weights(quantization, tmp_path: Path) -> None:
    """The real path: ``LLM(quantization=...)`` (C++ kernels, cpu backend, chunked prefill)."""
    hf_model = save_tiny_checkpoint(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", quantization=quantization, max_num_batched_tokens=16)
    engine_int4 = QuantScheme(4, INT4_DEFAULT_GROUP, symmetric=False)
    scheme = QuantScheme(8) if quantization == "int8" else engine_int4  # the engine's
    fake_quantize_model(hf_model, scheme)
    prompts = [[5, 6, 7], list(range(3, 30))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 12) for p in prompts]
    model = llm.engine.worker.model
    quantized = [m for m in model.modules() if getattr(m, "quantization", None) is not None and m is not model]
    assert quantized and all(not hasattr(m, "weight") for m in quantized)
    with pytest.raises(WeightError, match="quantized"):
        llm.update_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])


def test_tensor_parallel_quantized_equals_transformers(tmp_path: Path) -> None:
    """Each rank quantizes its own shard: row-parallel shards split K, so a rank's K (64 of the MLP's
    128) must hold whole groups."""
    hf_model = save_tiny_checkpoint(tmp_path, intermediate_size=128)
    llm = LLM(
        model=str(tmp_path), dtype="float32", quantization="int4", quantization_group_size=32, tensor_parallel_size=2
    )
    try:
        fake_quantize_model(hf_model, QuantScheme(4, 32, symmetric=False))
        prompts = [[5, 6, 7], list(range(3, 20))]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 8) for p in prompts]
    finally:
        llm.shutdown()


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_anything_changes(tmp_path: Path) -> None:
    """An explicit group size must fit every layer; the default groups skip a layer none fits."""
    save_tiny_model(tmp_path, "llama")  # intermediate_size 96: groups of 64 do not divide the down projection
    model = load_model(tmp_path, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj .*groups of 64"):
        quantize_model(model, QuantScheme(4, 64))
    assert model.quantization is None and all(hasattr(layer.mlp.down_proj, "weight") for layer in model.model.layers)
    n_layers = model.config.num_layers
    assert quantize_model(model, QuantScheme(4)) == 4 * n_layers + 1  # default groups: 96 fits groups of 32; + the head
    save_tiny_model(tmp_path / "odd", "llama", intermediate_size=80)  # 80 is no multiple of 32
    odd = load_model(tmp_path / "odd", torch.float32, "cpu")
    assert quantize_model(odd, QuantScheme(8)) == 3 * n_layers + 1
    assert all(hasattr(layer.mlp.down_proj, "weight") for layer in odd.model.layers)
    assert all(layer.mlp.gate_up_proj.quantization == QuantScheme(8) for layer in odd.model.layers)
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=str(tmp_path), quantization="int3")
    with pytest.raises(ValueError, match='quantized_activations must be "int16" or "int8"'):
        LLM(model=str(tmp_path), quantization="int4", quantized_activations="int4")
    with pytest.raises(ValueError, match="activation passes must be 1 or 2"):
        set_activation_passes(odd, 3)
