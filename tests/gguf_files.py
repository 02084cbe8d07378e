"""GGUF files written from tiny random transformers models the way llama.cpp's ``convert_hf_to_gguf.py``
writes them: its metadata keys, the tiny model's byte-level BPE as the GGUF tokenizer, tensors renamed
by the ``gguf`` package's name table (the Q and K rows of "llama" permuted for llama.cpp's rotary
layout), 1-D tensors in F32, the others in a chosen ggml type (quantized by ``gguf.quants``), and no
``output.weight`` when the embeddings are tied."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import transformers
from gguf import (
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
    get_tensor_name_map,
    quants,
)

from tests.tiny_models import make_hf_model
from tokenmill.default_model import TINY_MODEL_DIR

F32 = GGMLQuantizationType.F32
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""The GGUF names of a decoder layer's projections (``blk.<i>.<name>.weight``)."""

SMALL_VOCAB = 512
"""The vocabulary size of the models here unless a test asks for another: the tiny tokenizer's first
512 tokens and the merges among them (reading all 8192 tokens' metadata takes the ``gguf`` package
and transformers seconds per file)."""


def gguf_tensors(hf_model: transformers.PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """``hf_model``'s weights in fp32 under their GGUF names, in torch order, as llama.cpp's converter
    stores them: Q and K rows permuted for arch "llama", no ``output.weight`` for tied embeddings."""
    config = hf_model.config
    table = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = permute_for_llama_cpp(data, heads)
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        tensors[gguf_name] = data
    return tensors


def permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from halves to interleaved pairs."""
    rows, k = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, k).swapaxes(1, 2).reshape(rows, k)


def write_gguf(
    path: Path,
    config: transformers.PretrainedConfig,
    tensors: dict[str, np.ndarray],
    arch: str,
    projection_type: GGMLQuantizationType = F32,
    embedding_type: GGMLQuantizationType = F32,
) -> Path:
    """Write a GGUF file of architecture ``arch`` at ``path``: ``config``'s hyperparameters, the tiny
    tokenizer's first ``config.vocab_size`` tokens, and ``tensors`` (GGUF names, fp32, torch order):
    decoder projections in ``projection_type``, ``token_embd``/``output`` in ``embedding_type``,
    everything else in F32."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_vocab_size(config.vocab_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(
        LlamaFileType.ALL_F32 if projection_type == F32 else LlamaFileType[f"MOSTLY_{projection_type.name}"]
    )
    _add_tokenizer(writer, config.vocab_size)
    for name, data in tensors.items():
        kind = name.split(".")[-2]
        qtype = F32 if data.ndim == 1 else projection_type if kind in PROJECTIONS else embedding_type
        if qtype == F32:
            writer.add_tensor(name, data.astype(np.float32))
        else:  # rows of blocks [N, bytes]: the writer takes the shape from the bytes and the type
            writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """A tiny random model of ``kind`` ("llama", "qwen2") written as the GGUF file ``path``; returns the model."""
    hf_model = tiny_gguf_model(kind, seed, **overrides)
    write_gguf(path, hf_model.config, gguf_tensors(hf_model, kind), kind, projection_type, embedding_type)
    return hf_model


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
