"""GGUF files written from tiny random transformers models the way llama.cpp's ``convert_hf_to_gguf.py``
writes them: its metadata keys per architecture, the tiny model's byte-level BPE as the GGUF tokenizer,
tensors renamed by the ``gguf`` package's name table (the Q and K rows of "llama" permuted for
llama.cpp's rotary layout, Gemma's norm weights stored as ``1 + w``, Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` as they are, under ``attn_qkv`` and ``ffn_up``, MoE experts stacked per projection
as ``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps`` ``[E, N, K]``), 1-D tensors and MoE routers in
F32, the others in a chosen ggml type (quantized by ``gguf.quants``), and no ``output.weight`` when
the embeddings are tied."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from gguf import (
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    LlamaFileType,
    TokenType,
    get_tensor_name_map,
    quants,
)

from tests.tiny_models import make_hf_model
from tokenmill.default_model import TINY_MODEL_DIR

F32 = GGMLQuantizationType.F32
PROJECTIONS = (
    *("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
    *("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
)
"""The GGUF names of a decoder layer's projections (``blk.<i>.<name>.weight``), stacked experts included."""
ROUTER = "ffn_gate_inp"
"""The GGUF name of an MoE router, which llama.cpp's converter keeps in F32."""

GGUF_ARCHITECTURES = {"mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe"}
"""Model kinds llama.cpp's converter writes as another GGUF architecture (``LlamaModel`` converts
``MistralForCausalLM`` and ``MixtralForCausalLM``); every other kind is its own."""

NORM_OFFSET_ARCHITECTURES = ("gemma2", "gemma3")
"""GGUF architectures whose norm weights llama.cpp stores as ``1 + w`` (Gemma's RMSNorm scales by it)."""

SMALL_VOCAB = 512
"""The vocabulary size of the models here unless a test asks for another: the tiny tokenizer's first
512 tokens and the merges among them (reading all 8192 tokens' metadata takes the ``gguf`` package
and transformers seconds per file)."""


def gguf_architecture(kind: str) -> str:
    """The GGUF architecture llama.cpp's converter writes a model of ``kind`` as."""
    return GGUF_ARCHITECTURES.get(kind, kind)


def norm_offset(arch: str, name: str) -> float:
    """What llama.cpp's converter adds to the checkpoint tensor ``name`` of architecture ``arch``."""
    return 1.0 if arch in NORM_OFFSET_ARCHITECTURES and name.endswith("norm.weight") else 0.0


def gguf_tensors(hf_model: transformers.PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """``hf_model``'s weights in fp32 under their GGUF names, in torch order, as llama.cpp's converter
    stores them: Q and K rows permuted for arch "llama", Gemma's norms plus one, stacked experts split
    into their gate, up and down stacks, no ``output.weight`` for tied embeddings."""
    config = hf_model.config
    table = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy() + np.float32(norm_offset(arch, name))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = permute_for_llama_cpp(data, heads)
        stacks = _expert_stacks(name, data)
        if stacks:
            tensors.update((table[stack_name] + ".weight", stack) for stack_name, stack in stacks.items())
            continue
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        tensors[gguf_name] = data
    return tensors


def _expert_stacks(name: str, data: np.ndarray) -> dict[str, np.ndarray]:
    """transformers' stacked experts ``<experts>.gate_up_proj`` ``[E, 2I, hidden]`` (gate rows first)
    and ``<experts>.down_proj`` ``[E, hidden, I]`` by the per-projection names the ``gguf`` package
    maps to llama.cpp's stacks (``<experts>.gate_proj``, ``up_proj``, ``down_proj``); empty for
    any other tensor."""
    experts, _, leaf = name.rpartition(".")
    if not experts.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
        return {}
    if leaf == "down_proj":
        return {name: data}
    gate, up = np.split(data, 2, axis=1)
    return {f"{experts}.gate_proj": gate, f"{experts}.up_proj": up}


def on_file_weights(hf_model: transformers.PreTrainedModel, path: Path, arch: str) -> transformers.PreTrainedModel:
    """``hf_model`` (changed in place, returned) with every weight the GGUF file ``path`` (written from
    it by :func:`write_gguf`) holds, dequantized by ``gguf.quants``, what :func:`gguf_tensors` changed
    undone: the oracle for files transformers cannot read whole (Mixtral's experts)."""
    config = hf_model.config
    table = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
    stored = {
        t.name: quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape.tolist())])
        for t in GGUFReader(path).tensors
    }
    weights = {}
    for name, tensor in hf_model.state_dict().items():
        experts, _, leaf = name.rpartition(".")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if experts.endswith(".experts") and leaf == "gate_up_proj":
            data = np.concatenate([stored[table[f"{experts}.{p}"] + ".weight"] for p in ("gate_proj", "up_proj")], 1)
        elif experts.endswith(".experts") and leaf == "down_proj":
            data = stored[table[name] + ".weight"]
        else:
            data = stored[table.get_name(name, try_suffixes=(".weight", ".bias"))]
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = unpermute_from_llama_cpp(data, heads)
        weights[name] = torch.from_numpy(data - np.float32(norm_offset(arch, name))).to(tensor.dtype)
    hf_model.load_state_dict(weights, strict=not config.tie_word_embeddings)
    return hf_model


def permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from halves to interleaved pairs."""
    rows, k = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, k).swapaxes(1, 2).reshape(rows, k)


def unpermute_from_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute_for_llama_cpp`."""
    rows, k = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, k).swapaxes(1, 2).reshape(rows, k)


def write_gguf(
    path: Path,
    config: transformers.PretrainedConfig,
    tensors: dict[str, np.ndarray],
    arch: str,
    projection_type: GGMLQuantizationType = F32,
    embedding_type: GGMLQuantizationType = F32,
    kind_types: Mapping[str, GGMLQuantizationType] | None = None,
) -> Path:
    """Write a GGUF file of architecture ``arch`` at ``path``: ``config``'s hyperparameters, the tiny
    tokenizer's first ``config.vocab_size`` tokens, and ``tensors`` (GGUF names, fp32, torch order):
    decoder projections (stacked experts too) in ``projection_type``, ``token_embd``/``output`` in
    ``embedding_type``, everything else in F32; ``kind_types`` overrides the types of the first two
    per kind (``{"ffn_down_exps": Q5_1}``: ``blk.<i>.ffn_down_exps.weight``)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _add_hyperparameters(writer, config, arch)
    writer.add_file_type(
        LlamaFileType.ALL_F32 if projection_type == F32 else LlamaFileType[f"MOSTLY_{projection_type.name}"]
    )
    _add_tokenizer(writer, config.vocab_size)
    for name, data in tensors.items():
        kind = name.split(".")[-2]
        default = projection_type if kind in PROJECTIONS else embedding_type
        qtype = F32 if data.ndim == 1 or kind == ROUTER else (kind_types or {}).get(kind, default)
        if qtype == F32:
            writer.add_tensor(name, data.astype(np.float32))
        else:  # rows of blocks [..., N, bytes]: the writer takes the shape from the bytes and the type
            blocks = quantize_q6_k(data) if qtype == GGMLQuantizationType.Q6_K else quants.quantize(data, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """``weight [N, K]`` (K a multiple of 256) as Q6_K blocks, rows of bytes ``[N, K / 256 * 210]``
    (the ``gguf`` package cannot quantize K-quants): per sub-block of 16 the step ``absmax / 31``,
    stored as ``d * sc`` (``d`` fp16 per 256 values, ``sc`` int8), and ``q = round(w / (d sc)) + 32``
    in 0..63, its low nibble in ``ql`` and its top two bits in ``qh`` as ggml lays them out."""
    n, k = weight.shape
    values = weight.astype(np.float32).reshape(n, k // 256, 16, 16)
    steps = np.abs(values).max(axis=-1) / 31  # [n, supers, 16]
    d = (steps.max(axis=-1, keepdims=True) / 127).astype(np.float16)
    d = np.where(d == 0, np.float16(1), d)
    sc = np.clip(np.round(steps / d.astype(np.float32)), 1, 127).astype(np.int8)
    unit = d.astype(np.float32) * sc.astype(np.float32)
    q = (np.clip(np.round(values / unit[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 4, 32)  # per half of 128 values: 4 runs of 32
    low = q & 15
    ql = np.concatenate([low[..., 0, :] | low[..., 2, :] << 4, low[..., 1, :] | low[..., 3, :] << 4], axis=-1)
    qh = sum((q[..., i, :] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
    blocks = np.concatenate(
        [ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64), sc.view(np.uint8), d.view(np.uint8)], axis=-1
    )
    return blocks.reshape(n, -1)


def tiny_gguf_model(kind: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """``tests.tiny_models.make_hf_model`` with the tiny tokenizer's special token ids and SMALL_VOCAB
    tokens (``vocab_size`` overrides it: up to the tokenizer's 8192)."""
    return make_hf_model(kind, seed, **{"vocab_size": SMALL_VOCAB, "bos_token_id": 0, "eos_token_id": 0, **overrides})


def save_gguf(
    path: Path,
    kind: str,
    projection_type: GGMLQuantizationType = F32,
    embedding_type: GGMLQuantizationType = F32,
    seed: int = 0,
    kind_types: Mapping[str, GGMLQuantizationType] | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """A tiny random model of ``kind`` (``tests.tiny_models``' kinds) written as the GGUF file ``path``
    (types as :func:`write_gguf` takes them); returns the model."""
    hf_model = tiny_gguf_model(kind, seed, **overrides)
    arch = gguf_architecture(kind)
    tensors = gguf_tensors(hf_model, arch)
    write_gguf(path, hf_model.config, tensors, arch, projection_type, embedding_type, kind_types)
    return hf_model


def _add_hyperparameters(writer: GGUFWriter, config: transformers.PretrainedConfig, arch: str) -> None:
    """``config``'s hyperparameters as llama.cpp's ``set_gguf_parameters`` writes them for ``arch``:
    ``TextModel``'s (key/value lengths when the config has a ``head_dim``, expert counts for a mixture
    of experts), then what ``LlamaModel`` adds (the vocabulary size, the rotary dims),
    ``Qwen2MoeModel``'s (the experts' width), or ``Phi3MiniModel``'s (rotary dims, longrope's
    original context, the window, 0 for none, no key length), ``Gemma2Model``'s (no rope base: 10000;
    the soft-caps and the window) or ``Gemma3Model``'s (the global layers' rope base, the window, the
    final soft-cap when set). Nothing says which layers slide, nor Gemma's ``query_pre_attn_scalar``
    (llama.cpp scales by ``head_dim ** -0.5``, transformers by ``256 ** -0.5``), nor Gemma 3's local
    rope base (10000 in both)."""
    head_dim = config.to_dict().get("head_dim")
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "gemma2":
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch != "phi3" and head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim or config.hidden_size // config.num_attention_heads)
    elif arch == "phi3":
        rotary = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    elif arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    elif arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _add_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    """The tiny model's byte-level BPE (its first ``vocab_size`` tokens, and the merges among them) as
    llama.cpp's ``_set_vocab_gpt2`` and ``SpecialVocab`` write it: tokens by id (added special ones
    CONTROL), merges as "a b", special token ids and flags, the chat template."""
    spec = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())
    settings = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
    vocab = {token: i for token, i in spec["model"]["vocab"].items() if i < vocab_size}
    added = {t["id"]: t for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(vocab_size))
    types = [
        TokenType.NORMAL if i not in added else TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED
        for i in range(len(tokens))
    ]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in spec["model"]["merges"] if {a, b, a + b} <= vocab.keys()])
    writer.add_bos_token_id(vocab[settings["bos_token"]])
    writer.add_eos_token_id(vocab[settings["eos_token"]])
    writer.add_pad_token_id(vocab[settings["pad_token"]])
    writer.add_add_bos_token(settings["add_bos_token"])
    writer.add_add_eos_token(settings["add_eos_token"])
    writer.add_chat_template(settings["chat_template"])
