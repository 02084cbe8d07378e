"""GGUF files end to end: tiny random models written as llama.cpp's converter writes them
(``tests/gguf_files.py``) run in tokenmill as transformers runs them (its own GGUF loader, which
dequantizes, is the oracle), Qwen3-MoE's stacked experts included, their tokenizer and chat template
are transformers', Mixtral's "llama" files with experts run as transformers' Mixtral on the file's
weights (transformers' GGUF loader reads them without their experts), and bad files are clear errors
raised by ``LLM(model=...)``."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.gguf_files import (
    F32,
    gguf_architecture,
    gguf_tensors,
    norm_offset,
    on_file_weights,
    save_gguf,
    tiny_gguf_model,
    write_gguf,
)
from tests.model.test_parity import PROMPT_LENS, assert_counting_prompts_match, greedy_through_cache, hf_reference
from tests.tiny_models import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.default_model import TINY_MODEL_DIR
from tokenmill.gguf_checkpoint import GGUFError, checkpoint_folder
from tokenmill.kernels.quant_format import fake_quantize_activations
from tokenmill.kernels.quant_linear import int8_dot_products
from tokenmill.model.loader import load_model
from tokenmill.model.weights import WeightError

Q = GGMLQuantizationType
NAME = "tiny.gguf"
ENGINE_PROMPTS = [[5, 6, 7], list(range(3, 30))]
ENGINE_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Conversions go to a temporary cache, never ``~/.cache``."""
    root = tmp_path_factory.mktemp("tokenmill-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An F32 Llama (GQA, untied) GGUF file, alone in its folder."""
    path = tmp_path_factory.mktemp("llama") / NAME
    save_gguf(path, "llama")
    return path


def transformers_model(path: Path) -> transformers.PreTrainedModel:
    """transformers' model of the GGUF file ``path`` in fp32 (never stopping at EOS)."""
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


@contextmanager
def running(model: Path) -> Iterator[LLM]:
    """``LLM(model=...)`` in fp32, shut down on leaving."""
    llm = LLM(model=str(model), dtype="float32")
    try:
        yield llm
    finally:
        llm.shutdown()


def greedy(llm: LLM) -> list[list[int]]:
    """``llm``'s greedy tokens for ENGINE_PROMPTS."""
    params = SamplingParams(max_tokens=ENGINE_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)]


MOE = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
"""Tiny Qwen3-MoE settings: transformers reads no expert width from a qwen3moe file (its config
class's 768, kept here) and takes ``norm_topk_prob`` true, as llama.cpp runs the file."""

GEMMA_SCALE = dict(head_dim=256)
"""Gemma files say nothing of ``query_pre_attn_scalar``: transformers takes 256, llama.cpp ``head_dim``
(but for the 27B models); with ``head_dim`` 256, as in Gemma 2 2B/9B and Gemma 3 1B-12B, both agree."""

F32_CASES = {
    "llama_gqa_untied": ("llama", dict(tie_word_embeddings=False)),
    "llama_gqa_tied_head_dim": ("llama", dict(tie_word_embeddings=True, head_dim=24)),
    "qwen2_qkv_bias_tied": ("qwen2", dict(tie_word_embeddings=True)),
    # transformers reads no head_dim from a qwen3 file (its key_length): Qwen3Config's 128, as in Qwen3
    "qwen3_qk_norm_tied_head_dim_128": ("qwen3", dict(tie_word_embeddings=True, head_dim=128)),
    # llama.cpp converts Mistral with LlamaModel: architecture "llama", Q/K permuted, no window written
    "mistral_as_llama_untied": ("mistral", dict(tie_word_embeddings=False)),
    "phi3_fused_qkv_gate_up_untied": ("phi3", dict(tie_word_embeddings=False)),
    "qwen3moe_stacked_experts_qk_norm_untied": ("qwen3_moe", dict(MOE, tie_word_embeddings=False)),
    # windows of 8, crossed by the longer prompts; Gemma 2's soft-caps are the defaults, which
    # transformers takes (it reads neither from the file); no rope base in a gemma2 file (10000)
    "gemma2_window_softcaps_tied": ("gemma2", dict(GEMMA_SCALE, sliding_window=8)),
    # six layers for a global one: nothing in the file says which layers slide (five of six in
    # llama.cpp and transformers); the global layers' rope base is the file's, the local ones' 10000
    "gemma3_window_qk_norm_tied": (
        "gemma3",
        dict(
            GEMMA_SCALE,
            num_hidden_layers=6,
            sliding_window=8,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(F32_CASES))
def test_f32_file_matches_transformers(case: str, tmp_path: Path) -> None:
    """An F32 file reads back in transformers as the model it was written from (the writer is
    faithful): its weights (Gemma's norms as ``(1 + w) - 1`` in fp32, which Gemma's ``1 + w`` turns
    back into the same scale) and its logits on a prompt past every window; and tokenmill's prefill
    logits (to 1e-4) and greedy tokens, through the KV cache and through ``LLM``, equal transformers'
    on it."""
    kind, overrides = F32_CASES[case]
    original = save_gguf(tmp_path / NAME, kind, **overrides)
    reference = transformers_model(tmp_path / NAME)
    written, read = original.state_dict(), reference.state_dict()
    offsets = {k: norm_offset(gguf_architecture(kind), k) for k in written}
    assert written.keys() == read.keys()
    assert all(torch.equal(read[k], written[k] + offsets[k] - offsets[k]) for k in written)
    prompt = torch.tensor([list(range(3, 3 + max(PROMPT_LENS)))])
    with torch.no_grad():
        torch.testing.assert_close(reference(prompt).logits, original(prompt).logits)
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.float32, "cpu")
    assert model.config.tie_word_embeddings is False  # the head loads from token_embd.weight when tied
    assert_counting_prompts_match(model, reference)
    with running(tmp_path / NAME) as llm:
        assert greedy(llm) == [hf_greedy(reference, p, ENGINE_TOKENS) for p in ENGINE_PROMPTS]


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
"""Llama 3.1's RoPE scaling, with an original context short enough to scale most of a tiny head's frequencies."""


def test_a_rope_freqs_tensor_is_llama_3_1_scaling(tmp_path: Path) -> None:
    """llama.cpp writes Llama 3.1's RoPE scaling as a ``rope_freqs`` tensor (each frequency's divisor)
    and no metadata, and transformers' GGUF reader ignores it: tokenmill runs the file as the scaled
    model (prefill logits to 1e-4 and greedy tokens of transformers' model with that scaling), not
    as the unscaled model transformers reads."""
    scaled = tiny_gguf_model("llama", rope_parameters=LLAMA3_ROPE, max_position_embeddings=512)
    head_dim = scaled.config.head_dim
    plain_inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factors = plain_inv_freq / scaled.model.rotary_emb.inv_freq
    assert factors.min() == 1.0 and ((factors > 1) & (factors < 8)).any() and factors.max() == pytest.approx(8.0)
    tensors = {**gguf_tensors(scaled, "llama"), "rope_freqs.weight": factors.numpy().astype(np.float32)}
    write_gguf(tmp_path / NAME, scaled.config, tensors, "llama")
    unscaled = transformers_model(tmp_path / NAME)
    prompt = torch.tensor([list(range(3, 3 + max(PROMPT_LENS)))])
    with torch.no_grad():
        assert (unscaled(prompt).logits - scaled(prompt).logits).abs().max() > 1e-2  # the scaling matters
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.float32, "cpu")
    assert model.config.rope.freq_factors == pytest.approx(factors.tolist())
    assert_counting_prompts_match(model, scaled)
    scaled.generation_config.eos_token_id = None
    with running(tmp_path / NAME) as llm:
        assert greedy(llm) == [hf_greedy(scaled, p, ENGINE_TOKENS) for p in ENGINE_PROMPTS]


QUANTIZED_CASES = {
    "q8_0_tied_q8_0_embeddings": (Q.Q8_0, Q.Q8_0, True),
    "q4_0_untied": (Q.Q4_0, F32, False),
    "q4_1_untied_q4_1_head": (Q.Q4_1, Q.Q4_1, False),
    "q5_0_as_int8": (Q.Q5_0, F32, False),
    "q5_1_dequantized": (Q.Q5_1, F32, False),
}
"""Projection type, embedding (and untied head) type, tied embeddings."""


@pytest.mark.usefixtures("exact_fp32_activations")
@pytest.mark.parametrize("case", sorted(QUANTIZED_CASES))
def test_quantized_file_matches_transformers_on_its_dequantized_weights(case: str, tmp_path: Path) -> None:
    """A Llama with quantized projections: Q8_0/Q5_0/Q4_0/Q4_1 ones (and a Q8_0/Q4_1 LM head, tied or
    not) stay quantized (Q5_0 as int8), Q5_1 ones are dequantized; either way tokenmill's logits (to 1e-4) and
    greedy tokens equal transformers', which dequantizes every tensor."""
    projection_type, embedding_type, tied = QUANTIZED_CASES[case]
    save_gguf(tmp_path / NAME, "llama", projection_type, embedding_type, tie_word_embeddings=tied)
    reference = transformers_model(tmp_path / NAME)
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.float32, "cpu")
    bits = {Q.Q5_1: None, Q.Q8_0: 8, Q.Q5_0: 8}.get(projection_type, 4)
    for layer in model.model.layers:
        for projection in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert hasattr(projection, "weight") == (bits is None)
            assert (projection.quantization and projection.quantization.bits) == bits
    assert (model.lm_head.quantization is not None) == (embedding_type != F32)
    assert_counting_prompts_match(model, reference)
    with running(tmp_path / NAME) as llm:
        assert greedy(llm) == [hf_greedy(reference, p, ENGINE_TOKENS) for p in ENGINE_PROMPTS]


Q6_K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""A Llama whose projections' widths are whole Q6_K super-blocks (256 values)."""
Q4_K_M_LIKE = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}
"""Q4_K_M's Q6_K tensors (the rest Q8_0 here: ``gguf`` cannot quantize Q4_K)."""


def q6_k_file(path: Path) -> transformers.PreTrainedModel:
    """A Llama file with Q8_0 projections but Q6_K ``attn_v`` and ``ffn_down``, F32 embeddings; returns
    transformers' model of it (fp32, the file's weights dequantized)."""
    save_gguf(path, "llama", Q.Q8_0, F32, kind_types=Q4_K_M_LIKE, **Q6_K_SHAPE)
    return transformers_model(path)


@pytest.mark.usefixtures("exact_fp32_activations")
def test_q6_k_projections_are_dequantized_where_the_panels_layout_is_not_kept(tmp_path: Path) -> None:
    """In fp32 (no panels layout) a projection with a Q6_K tensor is dequantized (its groups of 16
    need the panels layout), the Q8_0 ones stay int8; logits (to 1e-4) and greedy tokens are
    transformers'."""
    reference = q6_k_file(tmp_path / NAME)
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.float32, "cpu")
    for layer in model.model.layers:
        assert hasattr(layer.self_attn.qkv_proj, "weight") and hasattr(layer.mlp.down_proj, "weight")
        assert layer.self_attn.o_proj.quantization.bits == layer.mlp.gate_up_proj.quantization.bits == 8
    assert_counting_prompts_match(model, reference)
    with running(tmp_path / NAME) as llm:
        assert greedy(llm) == [hf_greedy(reference, p, ENGINE_TOKENS) for p in ENGINE_PROMPTS]


MOE_QUANTIZED_CASES = {
    "q8_0_experts": (Q.Q8_0, Q.Q8_0),
    "q4_1_gate_up_q5_0_down": (Q.Q4_1, Q.Q5_0),
    "q4_0_gate_up_q5_1_down_dequantized": (Q.Q4_0, Q.Q5_1),
    "q5_1_experts_dequantized": (Q.Q5_1, Q.Q5_1),
}
"""The type of the projections (attention and the experts' gate/up stacks), of the down stacks."""


@pytest.mark.usefixtures("exact_fp32_activations")
@pytest.mark.parametrize("case", sorted(MOE_QUANTIZED_CASES))
def test_quantized_moe_file_matches_transformers_on_its_dequantized_weights(case: str, tmp_path: Path) -> None:
    """A Qwen3-MoE with quantized experts: each expert's gate/up and down projection stored in a
    lossless type stays quantized (the experts unstacked into per-expert layers, Q5_0 as int8), one
    in another type (Q5_1) is dequantized (the stacks kept when both are); routers stay fp32. Either
    way tokenmill's logits (to 1e-4) and greedy tokens equal transformers', which dequantizes every tensor."""
    projection_type, down_type = MOE_QUANTIZED_CASES[case]
    hf_model = tiny_gguf_model("qwen3_moe", **MOE)
    tensors = gguf_tensors(hf_model, "qwen3moe")
    write_gguf(
        tmp_path / NAME, hf_model.config, tensors, "qwen3moe", projection_type, kind_types={"ffn_down_exps": down_type}
    )
    reference = transformers_model(tmp_path / NAME)
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.float32, "cpu")
    bits = {Q.Q8_0: 8, Q.Q5_0: 8, Q.Q4_0: 4, Q.Q4_1: 4}
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert layer.mlp.gate.quantization is None and (experts.layers is None) == (case == "q5_1_experts_dequantized")
        for gate_up, down in experts.layers or []:
            assert (gate_up.quantization and gate_up.quantization.bits) == bits.get(projection_type)
            assert (down.quantization and down.quantization.bits) == bits.get(down_type)
            assert hasattr(down, "weight") == (down_type not in bits)
    assert_counting_prompts_match(model, reference)
    with running(tmp_path / NAME) as llm:
        assert greedy(llm) == [hf_greedy(reference, p, ENGINE_TOKENS) for p in ENGINE_PROMPTS]


@pytest.mark.skipif(not int8_dot_products(), reason="needs AVX2 or AVX512-VNNI (the panels layout's int8 kernel)")
def test_q6_k_projections_stay_quantized_in_the_panels_layout(tmp_path: Path) -> None:
    """A bf16 model on a CPU with the int8 kernel keeps Q6_K projections as int8 groups of 16 in the panels layout
    (``qkv_proj`` joins Q8_0 q/k, groups of 32, with a Q6_K v at 16): the oracle is transformers in
    fp32 on the file's weights with each projection's input quantized as the kernel does (blocks of
    its group), and our bf16 error stays within twice transformers' own bf16 error."""
    truth_model = q6_k_file(tmp_path / NAME)
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.bfloat16, "cpu")
    for layer in model.model.layers:
        for projection, group in [
            (layer.self_attn.qkv_proj, 16),
            (layer.mlp.down_proj, 16),
            (layer.self_attn.o_proj, 32),
            (layer.mlp.gate_up_proj, 32),
        ]:
            assert projection.qweight.dim() == 3 and projection.quantized_weight().group == group
    bf16_model = transformers_model(tmp_path / NAME).to(torch.bfloat16)
    for layer in truth_model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        blocks = {attention.q_proj: 16, attention.k_proj: 16, attention.v_proj: 16, mlp.down_proj: 16}
        blocks |= {attention.o_proj: 32, mlp.gate_proj: 32, mlp.up_proj: 32}
        for module, block in blocks.items():
            module.register_forward_pre_hook(lambda _, args, b=block: (fake_quantize_activations(args[0], b),))
    prompts = [list(range(3, 3 + n)) for n in PROMPT_LENS]
    logits, _ = greedy_through_cache(model, prompts)
    for prompt, ours in zip(prompts, logits):
        truth, _ = hf_reference(truth_model, prompt)
        theirs, _ = hf_reference(bf16_model, prompt)
        their_error, our_error = (theirs.float() - truth).abs().max(), (ours.float() - truth).abs().max()
        assert 0 < their_error and our_error <= 2 * their_error + 1e-2, (our_error, their_error)


MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)
MIXTRAL_CASES = {
    "f32": (F32, F32),
    "q8_0_experts": (Q.Q8_0, Q.Q8_0),
    "q4_1_gate_up_q4_0_down": (Q.Q4_1, Q.Q4_0),
    "q5_1_experts_dequantized": (Q.Q5_1, Q.Q5_1),
}
"""The type of the projections (attention and the experts' gate/up stacks), of the down stacks."""


@pytest.mark.parametrize("case", sorted(MIXTRAL_CASES))
def test_mixtral_file_runs_as_transformers_mixtral_on_its_weights(case: str, tmp_path: Path) -> None:
    """A "llama" file with experts, as llama.cpp's converter writes Mixtral (Q and K rows permuted,
    experts stacked), runs as ``MixtralForCausalLM``: experts in a lossless type stay quantized one by
    one, others are dequantized, routers stay fp32; logits (to 1e-4) and greedy tokens equal
    transformers' Mixtral the file was written from, on the file's weights (transformers' GGUF loader
    would read the file as a dense Llama without its experts)."""
    projection_type, down_type = MIXTRAL_CASES[case]
    hf_model = tiny_gguf_model("mixtral", **MIXTRAL)
    tensors = gguf_tensors(hf_model, "llama")
    write_gguf(
        tmp_path / NAME, hf_model.config, tensors, "llama", projection_type, kind_types={"ffn_down_exps": down_type}
    )
    reference = on_file_weights(hf_model, tmp_path / NAME, "llama").eval()
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.float32, "cpu")
    assert model.config.architecture == "MixtralForCausalLM" and model.config.sliding_window is None
    assert (model.config.moe.num_experts, model.config.moe.top_k, model.config.moe.renormalize) == (4, 2, True)
    bits = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4}
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert layer.mlp.gate.quantization is None and (experts.layers is None) == (down_type not in bits)
        for gate_up, down in experts.layers or []:
            assert (gate_up.quantization.bits, down.quantization.bits) == (bits[projection_type], bits[down_type])
    assert_counting_prompts_match(model, reference)
    with running(tmp_path / NAME) as llm:
        assert greedy(llm) == [hf_greedy(reference, p, ENGINE_TOKENS) for p in ENGINE_PROMPTS]


def test_qwen3moe_expert_width_is_read_from_the_file(tmp_path: Path) -> None:
    """A Qwen3-MoE file's expert width (``expert_feed_forward_length``) is the model's, where
    transformers keeps its config class's 768 and then fails on the tensors: tokenmill runs the
    file as the model it was written from runs."""
    original = save_gguf(tmp_path / NAME, "qwen3_moe", **MOE, moe_intermediate_size=32)
    model = load_model(checkpoint_folder(tmp_path / NAME), torch.float32, "cpu")
    assert model.config.moe.intermediate_size == 32
    with pytest.raises(RuntimeError, match="mismatch"):
        transformers_model(tmp_path / NAME)
    assert_counting_prompts_match(model, original)


TEXTS = [
    "def add(x, y):\n    return x + y\n",
    "  héllo wörld 😀 ½",
    "<|user|>hi<|end|>",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "Write Python."},
    {"role": "user", "content": "def f(x):"},
    {"role": "assistant", "content": "    return x"},
]


def test_tokenizer_and_chat_template_are_transformers(tmp_path: Path) -> None:
    """tokenmill's tokenizer of a GGUF file (the tiny tokenizer's whole vocabulary) encodes, decodes
    and renders the chat template as transformers' tokenizer of the file does, which tokenizes as the
    tokenizer the file was written from; ``LLM.chat`` prompts are those ids; the EOS id is the file's."""
    source = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    save_gguf(tmp_path / NAME, "llama", vocab_size=len(source))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=NAME)
    with running(tmp_path / NAME) as llm:
        ours = llm.engine.tokenizer
        assert len(ours.hf) == len(theirs) == len(source)
        for text in TEXTS:
            ids = ours.encode(text)
            assert ids == theirs.encode(text) == source.encode(text)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(TEXTS[1])) == TEXTS[1]
        rendered = theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
        assert rendered == source.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
        expected = theirs.encode(rendered, add_special_tokens=False)
        assert ours.apply_chat_template(CONVERSATION) == expected
        (out,) = llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False)
        assert out.prompt_token_ids == expected
        # the file's control tokens are special: typed in a message, one is text, not a turn marker
        end = theirs.convert_tokens_to_ids("<|end|>")
        assert ours.apply_chat_template([{"role": "user", "content": "<|end|>"}]).count(end) == 1
        assert llm.engine.eos_token_ids == {theirs.eos_token_id} == {0}


def not_gguf(path: Path) -> None:
    """Random bytes."""
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def truncated(keep: Callable[[int], int]) -> Callable[[Path], None]:
    """A writer of the tiny Llama cut to its first ``keep(size)`` bytes."""

    def write(path: Path) -> None:
        save_gguf(path, "llama")
        data = path.read_bytes()
        path.write_bytes(data[: keep(len(data))])

    return write


def architecture(name: str) -> Callable[[Path], None]:
    """A writer of the tiny Llama's tensors and metadata as architecture ``name``."""

    def write(path: Path) -> None:
        hf_model = tiny_gguf_model("llama")
        write_gguf(path, hf_model.config, gguf_tensors(hf_model, "llama"), name)

    return write


def edited(
    edit: Callable[[dict[str, np.ndarray]], None],
    projection_type: GGMLQuantizationType = F32,
    kind: str = "llama",
    **overrides: Any,
) -> Callable[[Path], None]:
    """A writer of the tiny model of ``kind`` (the Llama unless said) with its GGUF tensors changed by
    ``edit`` first."""

    def write(path: Path) -> None:
        hf_model = tiny_gguf_model(kind, **overrides)
        tensors = gguf_tensors(hf_model, gguf_architecture(kind))
        edit(tensors)
        write_gguf(path, hf_model.config, tensors, gguf_architecture(kind), projection_type)

    return write


def cut(name: str, rows: int | None = None, columns: int | None = None) -> Callable[[dict[str, np.ndarray]], None]:
    """An edit keeping tensor ``name``'s first ``rows`` rows (of a stack: experts) and ``columns``
    columns (None: all)."""

    def edit(tensors: dict[str, np.ndarray]) -> None:
        tensors[name] = tensors[name][:rows, :columns]

    return edit


BAD_FILES = {
    "not_gguf": (not_gguf, GGUFError, "is not a readable GGUF file"),
    "truncated_in_half": (truncated(lambda size: size // 2), GGUFError, r"is truncated: it is \d+ bytes long"),
    "truncated_in_metadata": (truncated(lambda size: 1000), GGUFError, "is truncated: it is 1000 bytes long"),
    "unknown_architecture_bloom": (architecture("bloom"), GGUFError, "architecture 'bloom' is not supported"),
    "made_up_architecture": (architecture("frobnicator"), GGUFError, "architecture 'frobnicator' is not supported"),
    "experts_in_a_qwen2_file": (
        lambda path: save_gguf(path, "qwen2", num_local_experts=4, num_experts_per_tok=2),
        GGUFError,
        "architecture 'qwen2' with 4 experts is not supported; mixtures of experts are supported in files of "
        "architecture 'qwen3moe' or 'llama'",
    ),
    "mixtral_using_more_experts_than_it_has": (
        lambda path: save_gguf(path, "mixtral", num_local_experts=4, num_experts_per_tok=5),
        GGUFError,
        "llama.expert_used_count 5 is not between 1 and expert_count 4",
    ),
    "expert_stack_of_3_not_expert_count": (
        edited(cut("blk.1.ffn_up_exps.weight", rows=3), kind="qwen3_moe", **MOE, moe_intermediate_size=32),
        WeightError,
        r"'blk\.1\.ffn_up_exps\.weight' \(for 'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight'\) has shape "
        r"\(3, 32, 64\), expected \(4, 32, 64\)",
    ),
    "k_rows_not_head_count_kv": (
        edited(cut("blk.0.attn_k.weight", rows=24)),
        WeightError,
        r"'blk\.0\.attn_k\.weight' \(for 'model\.layers\.0\.self_attn\.k_proj\.weight'\) has shape \(24, 64\), "
        r"expected \(32, 64\)",
    ),
    "q_rows_not_whole_heads": (
        edited(cut("blk.1.attn_q.weight", rows=60)),
        WeightError,
        r"'blk\.1\.attn_q\.weight' \(for 'model\.layers\.1\.self_attn\.q_proj\.weight'\) has shape \(60, 64\), "
        r"expected \(64, 64\)",
    ),
    "quantized_columns_not_embedding_length": (
        edited(cut("blk.1.ffn_up.weight", columns=32), Q.Q8_0),
        WeightError,
        r"'blk\.1\.ffn_up\.weight' \(for 'model\.layers\.1\.mlp\.up_proj\.weight'\) has shape \(96, 32\), "
        r"expected \(96, 64\)",
    ),
    "missing_tensor": (
        edited(lambda tensors: tensors.pop("blk.1.ffn_down.weight")),
        WeightError,
        r"no tensor for 'model\.layers\.1\.mlp\.down_proj\.weight' \(GGUF name 'blk\.1\.ffn_down\.weight'\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_are_clear_errors_from_llm(case: str, tmp_path: Path, cache_dir: Path) -> None:
    """Each bad file is an error naming the file and its problem, raised by ``LLM(model=...)``; a
    conversion that fails leaves nothing in the cache."""
    write, error, message = BAD_FILES[case]
    path = tmp_path / f"{case}.gguf"
    write(path)
    before = set((cache_dir / "gguf").glob("*")) if (cache_dir / "gguf").is_dir() else set()
    with pytest.raises(error, match=message) as raised:
        LLM(model=str(path), dtype="float32")
    assert str(path) in str(raised.value)
    if error is GGUFError:
        after = set((cache_dir / "gguf").glob("*")) if (cache_dir / "gguf").is_dir() else set()
        assert after == before


def test_a_folder_of_two_gguf_files_is_refused(llama_file: Path, tmp_path: Path) -> None:
    """A folder with two ``.gguf`` files names both and asks for one."""
    shutil.copy(llama_file, tmp_path / "a.gguf")
    shutil.copy(llama_file, tmp_path / "b.gguf")
    with pytest.raises(GGUFError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\): name one"):
        LLM(model=str(tmp_path), dtype="float32")


def test_a_folder_of_one_gguf_file_is_that_file(llama_file: Path) -> None:
    """``LLM(model=folder)`` runs the folder's one GGUF file, from the same converted folder and
    with the same tokens as ``LLM(model=file)``; the served name is the file's stem for a file path,
    the folder's name for a folder."""
    with running(llama_file) as by_file, running(llama_file.parent) as by_folder:
        assert by_file.engine.config.model_name() == "tiny"
        assert by_folder.engine.config.model_name() == llama_file.parent.name
        assert by_folder.engine.config.model_path() == by_file.engine.config.model_path()
        assert greedy(by_folder) == greedy(by_file)


def test_a_conversion_parses_the_file_once_and_gives_gguf_its_reader_back(
    llama_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converting a file (its config and tokenizer by transformers' loaders, which read it with
    ``gguf.GGUFReader`` too) parses it once, and ``gguf.GGUFReader`` is gguf's own again after."""
    import gguf

    parses = []
    original = gguf.GGUFReader
    monkeypatch.setattr(original, "_build_fields", _counting(original._build_fields, parses))
    copy = tmp_path / NAME
    shutil.copy(llama_file, copy)  # another path: converted anew
    checkpoint_folder(copy)
    assert len(parses) == 1
    assert gguf.GGUFReader is original


def _counting(method: Callable[..., Any], calls: list) -> Callable[..., Any]:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(self)
        return method(self, *args, **kwargs)

    return counted
