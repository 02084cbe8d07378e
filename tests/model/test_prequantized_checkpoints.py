"""Pre-quantized checkpoints (AWQ, GPTQ, compressed-tensors) against transformers.

Each test quantizes a tiny model's decoder projections the way the format publishes them: integer
values, zero points and scales are drawn, then packed here by each format's published rules (written
from AutoAWQ's, AutoGPTQ's and compressed-tensors' packers, independently of tokenmill's
unpacking). The oracle is transformers in fp32 with every projection's weight set to the format's
own dequantization of those integers (``(q - z) * s``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.test_parity import PROMPT_LENS, assert_counting_prompts_match, greedy_through_cache
from tests.tiny_models import hf_greedy, save_tiny_checkpoint, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.quant_linear import int8_dot_products
from tokenmill.model.config import ModelConfigError
from tokenmill.model.loader import load_model
from tokenmill.model.weights import WeightError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's packing order: nibble ``i`` of a word holds column ``AWQ_ORDER[i]`` of its 8."""

Quantizer = Callable[[str, torch.Tensor, torch.Generator], tuple[dict[str, torch.Tensor], torch.Tensor]]
"""(module name, fp weight [N, K], rng) -> (checkpoint tensors of the module, dequantized weight)."""


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as the int32 a checkpoint stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_columns(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``values [R, C]`` (unsigned) packed along C, ``32 / bits`` to an int32: value ``order[i]`` of
    each run at bits ``bits * i`` (plain order when None)."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    runs = values.to(torch.int64).reshape(values.shape[0], -1, per_word)
    words = sum(runs[:, :, order[i]] << (bits * i) for i in range(per_word))
    return to_int32(words)


def draw(rng: torch.Generator, n: int, k: int, group: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Scales ``[n, k / group]``, representable in ``scale_dtype``."""
    return (0.004 + 0.012 * torch.rand(n, k // group, generator=rng)).to(scale_dtype)


def awq(group: int) -> Quantizer:
    def quantize(name: str, w: torch.Tensor, rng: torch.Generator) -> tuple[dict, torch.Tensor]:
        n, k = w.shape
        q = torch.randint(0, 16, (n, k), generator=rng)
        z = torch.randint(0, 16, (n, k // group), generator=rng)
        s = draw(rng, n, k, group, torch.float16)
        tensors = {
            "qweight": pack_columns(q.T, 4, AWQ_ORDER),
            "qzeros": pack_columns(z.T, 4, AWQ_ORDER),
            "scales": s.T.contiguous(),
        }
        return tensors, dequant(q, z, s, group)

    return quantize


def gptq(group: int, v1: bool, sym: bool) -> Quantizer:
    def quantize(name: str, w: torch.Tensor, rng: torch.Generator) -> tuple[dict, torch.Tensor]:
        n, k = w.shape
        g = group if group > 0 else k
        q = torch.randint(0, 16, (n, k), generator=rng)
        z = torch.full((n, k // g), 8) if sym else torch.randint(1, 16, (n, k // g), generator=rng)
        s = draw(rng, n, k, g, torch.float16)
        tensors = {
            "qweight": pack_columns(q, 4).T.contiguous(),  # packed along K: [K / 8, N]
            "qzeros": pack_columns((z - 1 if v1 else z).T, 4),  # v1 stores zero - 1
            "scales": s.T.contiguous(),
            "g_idx": (torch.arange(k) // g).to(torch.int32),
        }
        return tensors, dequant(q, z, s, g)

    return quantize


def compressed_packed(group: int | None, sym: bool) -> Quantizer:
    def quantize(name: str, w: torch.Tensor, rng: torch.Generator) -> tuple[dict, torch.Tensor]:
        n, k = w.shape
        g = group or k
        v = torch.randint(-8, 8, (n, k), generator=rng)
        zp = torch.zeros(n, k // g, dtype=torch.int64) if sym else torch.randint(-8, 8, (n, k // g), generator=rng)
        s = draw(rng, n, k, g, torch.bfloat16)
        tensors = {
            "weight_packed": pack_columns(v + 8, 4),  # stored unsigned (pack_to_int32's offset)
            "weight_scale": s,
            "weight_shape": torch.tensor([n, k]),
        }
        if not sym:
            tensors["weight_zero_point"] = pack_columns((zp + 8).T, 4).T.contiguous()  # packed along N
        return tensors, dequant(v, zp, s, g)

    return quantize


def compressed_int8(name: str, w: torch.Tensor, rng: torch.Generator) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    v = torch.randint(-128, 128, (n, k), generator=rng)
    s = (0.0005 + 0.001 * torch.rand(n, 1, generator=rng)).to(torch.float16)
    tensors = {"weight": v.to(torch.int8), "weight_scale": s}
    return tensors, dequant(v, torch.zeros(n, 1, dtype=torch.int64), s, k)


def dequant(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """The formats' common formula ``(q - z) * s``, per group of ``group`` columns, in fp32."""
    return (q - z.repeat_interleave(group, dim=1)).float() * s.float().repeat_interleave(group, dim=1)


def ct_config(fmt: str, bits: int, strategy: str, group: int | None, sym: bool) -> dict:
    weights = dict(num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group, dynamic=False)
    inputs = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True) if bits == 8 else None
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


CASES: dict[str, tuple[Quantizer, dict]] = {
    "awq_g32": (awq(32), dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm")),
    "gptq_v1_sym_g32": (gptq(32, v1=True, sym=True), dict(quant_method="gptq", bits=4, group_size=32, desc_act=False)),
    "gptq_v2_asym_per_channel": (
        gptq(-1, v1=False, sym=False),
        dict(quant_method="gptq", bits=4, group_size=-1, desc_act=False, sym=False, checkpoint_format="gptq_v2"),
    ),
    "ct_w4a16_sym_g32": (compressed_packed(32, sym=True), ct_config("pack-quantized", 4, "group", 32, True)),
    "ct_w4a16_asym_channel": (
        compressed_packed(None, sym=False),
        ct_config("pack-quantized", 4, "channel", None, False),
    ),
    "ct_w8a8_channel": (compressed_int8, ct_config("int-quantized", 8, "channel", None, True)),
}


def quantize_checkpoint(
    path: Path, hf_model, quantizer: Quantizer, quantization_config: dict, seed: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """Rewrite the checkpoint at ``path`` (saved from ``hf_model``) with its decoder projections
    quantized by ``quantizer``; ``hf_model`` gets the dequantized weights (the oracle). Returns each
    module's checkpoint tensors."""
    rng = torch.Generator().manual_seed(seed)
    state = load_file(path / "model.safetensors")
    modules = {}
    for name, module in hf_model.model.layers.named_modules():
        if name.rpartition(".")[2] not in PROJECTIONS:
            continue
        full = f"model.layers.{name}"
        tensors, weight = quantizer(full, module.weight.detach(), rng)
        with torch.no_grad():
            module.weight.copy_(weight)
        del state[f"{full}.weight"]
        state.update({f"{full}.{leaf}": tensor.contiguous() for leaf, tensor in tensors.items()})
        modules[full] = tensors
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return modules


@pytest.mark.usefixtures("exact_fp32_activations")
@pytest.mark.parametrize("case", sorted(CASES))
def test_prequantized_checkpoint_matches_transformers_on_its_dequantized_weights(case: str, tmp_path: Path) -> None:
    quantizer, config = CASES[case]
    hf_model = save_tiny_model(tmp_path, "llama")
    quantize_checkpoint(tmp_path, hf_model, quantizer, config)
    model = load_model(tmp_path, torch.float32, "cpu")
    assert model.quantization is not None and model.checkpoint_quantization == config["quant_method"]
    layer = model.model.layers[0]
    assert not hasattr(layer.self_attn.qkv_proj, "weight") and layer.mlp.down_proj.quantization is not None
    assert_counting_prompts_match(model, hf_model)


@pytest.mark.usefixtures("exact_fp32_activations")
@pytest.mark.skipif(not int8_dot_products(), reason="needs AVX2 or AVX512-VNNI (the panels layout's int8 kernel)")
def test_bf16_prequantized_checkpoint_takes_the_panels_layout(tmp_path: Path) -> None:
    """In bf16 on a CPU with the int8 kernel a checkpoint's projections are repacked to the panels layout (int8
    activations), as quantizing at load does: the logits stay within bf16-and-int8-activation
    distance of the fp32 rows-layout model's (a packing error would be far off)."""
    quantizer, config = CASES["awq_g32"]
    quantize_checkpoint(tmp_path, save_tiny_model(tmp_path, "llama"), quantizer, config)
    bf16, fp32 = load_model(tmp_path, torch.bfloat16, "cpu"), load_model(tmp_path, torch.float32, "cpu")
    assert (
        bf16.model.layers[0].mlp.down_proj.qweight.dim() == 3 and fp32.model.layers[0].mlp.down_proj.qweight.dim() == 2
    )
    prompts = [list(range(3, 3 + n)) for n in PROMPT_LENS]
    for ours, reference in zip(greedy_through_cache(bf16, prompts)[0], greedy_through_cache(fp32, prompts)[0]):
        torch.testing.assert_close(ours.float(), reference, rtol=0.05, atol=0.05 * reference.abs().max().item())


def test_engine_generates_what_transformers_does_and_refuses_updates(tmp_path: Path) -> None:
    """The real path: ``LLM`` on a pre-quantized checkpoint (C++ kernels, chunked prefill), no
    ``quantization`` asked for."""
    quantizer, config = CASES["gptq_v1_sym_g32"]
    hf_model = save_tiny_checkpoint(tmp_path)
    quantize_checkpoint(tmp_path, hf_model, quantizer, config)
    hf_model.generation_config.eos_token_id = None  # ignore_eos below: compare every token
    llm = LLM(model=str(tmp_path), dtype="float32", max_num_batched_tokens=16)
    prompts = [[5, 6, 7], list(range(3, 30))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 12) for p in prompts]
    assert llm.engine.model.checkpoint_quantization == "gptq"
    with pytest.raises(WeightError, match="quantized"):
        llm.update_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(ValueError, match="pre-quantized checkpoint"):
        LLM(model=str(tmp_path), dtype="float32", quantization="int8")


def test_tensor_parallel_prequantized_equals_transformers(tmp_path: Path) -> None:
    """Each rank takes its rows of the column-parallel shards and its whole groups of the row-parallel
    ones' K (64 of the MLP's 128: two groups of 32)."""
    quantizer, config = CASES["awq_g32"]
    hf_model = save_tiny_checkpoint(tmp_path, intermediate_size=128)
    quantize_checkpoint(tmp_path, hf_model, quantizer, config)
    hf_model.generation_config.eos_token_id = None  # ignore_eos below: compare every token
    llm = LLM(model=str(tmp_path), dtype="float32", tensor_parallel_size=2)
    try:
        prompts = [[5, 6, 7], list(range(3, 20))]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 8) for p in prompts]
    finally:
        llm.shutdown()


def edit_checkpoint(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    state = load_file(path / "model.safetensors")
    edit(state)
    contiguous = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(contiguous, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("case", "changes", "match"),
    [
        ("awq_g32", dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
        ("awq_g32", dict(bits=8), "awq: quantization_config field bits=8"),
        ("awq_g32", dict(version="gemv"), "field version='gemv'"),
        ("awq_g32", dict(group_size=48), "field group_size=48"),
        ("gptq_v1_sym_g32", dict(desc_act=True), "field desc_act=True"),
        ("gptq_v1_sym_g32", dict(checkpoint_format="marlin"), "field checkpoint_format='marlin'"),
        ("ct_w4a16_sym_g32", dict(format="float-quantized"), "field format='float-quantized'"),
        ("ct_w4a16_sym_g32", dict(kv_cache_scheme={"num_bits": 8}), "field kv_cache_scheme"),
    ],
)
def test_an_unsupported_quantization_config_is_refused_naming_the_field(case, changes, match, tmp_path: Path) -> None:
    quantizer, config = CASES[case]
    quantize_checkpoint(tmp_path, save_tiny_model(tmp_path, "llama"), quantizer, config)
    edit_config(tmp_path, **changes)
    with pytest.raises(ModelConfigError, match=match):
        load_model(tmp_path, torch.float32, "cpu")


Q = "model.layers.1.self_attn.q_proj"
K = "model.layers.1.self_attn.k_proj"


def _drop(name: str) -> Callable[[dict], None]:
    return lambda state: state.pop(name)


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda state: state.update({name: value(state[name])})


def _half_q_rows(state: dict) -> None:
    """q_proj's tensors consistent with each other, but for 32 output rows instead of 64."""
    for leaf, cols in (("qweight", 4), ("qzeros", 4), ("scales", 32)):
        state[f"{Q}.{leaf}"] = state[f"{Q}.{leaf}"][:, :cols]


def _dequantized_k(state: dict) -> None:
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        state.pop(f"{K}.{leaf}")
    state[f"{K}.weight"] = torch.zeros(32, 64)


@pytest.mark.parametrize(
    ("case", "edit", "match"),
    [
        ("awq_g32", _drop(f"{Q}.qzeros"), f"missing tensor '{Q}.qzeros'"),
        ("awq_g32", _set(f"{Q}.scales", lambda t: t[:1]), rf"'{Q}.scales' has shape \(1, 64\), expected \(2, 64\)"),
        ("awq_g32", _set(f"{Q}.qweight", lambda t: t.float()), f"'{Q}.qweight' has dtype torch.float32"),
        ("awq_g32", _half_q_rows, rf"'{Q}.qweight' holds a weight of shape \(32, 64\), expected \(64, 64\)"),
        ("awq_g32", _set(f"{Q}.scales", lambda t: t.fill_(float("nan"))), f"'{Q}.qweight''s scales holds"),
        ("gptq_v1_sym_g32", _set(f"{Q}.g_idx", lambda t: t.flip(0)), f"'{Q}.g_idx' does not put input row k"),
        ("gptq_v1_sym_g32", _dequantized_k, "must be stored alike"),
        ("awq_g32", lambda state: state.update({"lm_head.qweight": torch.zeros(64, 12, dtype=torch.int32)}), "LM head"),
        ("ct_w4a16_sym_g32", _set(f"{Q}.weight_shape", lambda t: t + 8), f"'{Q}.weight_packed' has shape"),
    ],
)
def test_tensors_that_do_not_fit_the_config_are_refused_naming_the_tensor(case, edit, match, tmp_path: Path) -> None:
    quantizer, config = CASES[case]
    quantize_checkpoint(tmp_path, save_tiny_model(tmp_path, "llama"), quantizer, config)
    edit_checkpoint(tmp_path, edit)
    with pytest.raises(WeightError, match=match):
        load_model(tmp_path, torch.float32, "cpu")


def test_a_packed_projection_quantized_in_different_groups_is_refused(tmp_path: Path) -> None:
    """q_proj in groups of 32, k_proj and v_proj (config group 1) in groups of 64: one qkv_proj cannot hold both."""
    quantizer, config = CASES["ct_w4a16_sym_g32"]
    quantize_checkpoint(tmp_path, save_tiny_model(tmp_path, "llama"), quantizer, config)
    groups = config["config_groups"]
    wide = {**groups["group_0"], "targets": [r"re:.*\.(k|v)_proj$"]}
    wide["weights"] = {**wide["weights"], "group_size": 64}
    edit_config(tmp_path, config_groups={"group_1": wide, **groups})
    with pytest.raises(WeightError, match="packed into one projection but quantized differently"):
        load_model(tmp_path, torch.float32, "cpu")
