"""Load a GGUF file's weights (through its converted folder, ``gguf_checkpoint.py``) into a model.

The file is memory-mapped and every tensor read once. Names map from the model's Hugging Face
checkpoint names through the ``gguf`` package's tensor-name table for the architecture; the LM head
of a file without ``output.weight`` loads from ``token_embd.weight``. Undone on the way, as
``transformers`` undoes them: llama.cpp's rotary permutation of the Q and K rows ("llama"
architecture: rows of each head reordered from halves to interleaved pairs; a row permutation, so
quantized rows are permuted as they are) and Gemma's ``1 +`` folded into its norm weights.

A decoder-layer projection whose tensors are all of a type the quantized kernels run exactly
(``gguf_tensors.LOSSLESS_BITS``), with one bit width, keeps its quantized data (the panels layout
where ``quantization.keeps_panels`` says so; Q6_K's groups of 16 only there; int8 shards with groups
of 16 and of 32 joined at 16); so does an untied LM head; every other tensor is dequantized to the
model's dtype, and the start-up log says how many. Every expected tensor must be
in the file, with the expected shape; a missing, unexpected or misshapen one is a WeightError.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import QuantizedTensors, QuantScheme, dequantize
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.gguf_tensors import LOSSLESS_BITS, PANELS_ONLY, gguf_weight
from tokenmill.model.huge_pages import materialize_on_huge_pages, move_to_huge_pages
from tokenmill.model.quantization import ROUTER_NAME, keeps_panels, kernels_per_shape
from tokenmill.model.weights import WeightError, WeightTarget, check_tensor, checkpoint_targets

logger = logging.getLogger("tokenmill.model")

TIED_OUTPUT = "token_embd.weight"


class GGUFTensors:
    """The tensors of one GGUF file, by GGUF name, read from a memory map."""

    def __init__(self, index: dict) -> None:
        self.file = Path(index["file"])
        self.architecture: str = index["architecture"]
        self.tied_output: bool = index["tied_output"]
        self.entries = {t["name"]: t for t in index["tensors"]}
        self._data = np.memmap(self.file, dtype=np.uint8, mode="r")

    def qtype(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.entries[name]["type"])

    def read(self, name: str) -> QuantizedTensors | torch.Tensor:
        """Tensor ``name`` as :func:`gguf_weight` gives it (1-D tensors as fp32 ``[K]``)."""
        entry = self.entries[name]
        raw = self._data[entry["offset"] : entry["offset"] + entry["bytes"]]
        shape = entry["shape"]
        rows = (1, shape[0]) if len(shape) == 1 else (shape[0], int(np.prod(shape[1:])))
        try:
            weight = gguf_weight(raw, self.qtype(name), rows)
        except ValueError as exc:
            raise WeightError(f"{self.file}: tensor {name!r}: {exc}") from None
        return weight.reshape(shape) if isinstance(weight, torch.Tensor) else weight


def load_gguf(model: CausalLM, index: dict) -> None:
    """Load the file ``index`` describes into ``model`` (built on the meta device, in its dtype, not
    yet materialized), then materialize what is left: see the module docstring."""
    tensors = GGUFTensors(index)
    names = _gguf_names(model, tensors)
    missing = sorted(hf for hf, g in names.items() if g not in tensors.entries)
    if missing:
        raise WeightError(f"{tensors.file}: no tensor for {missing[0]!r} (GGUF name {names[missing[0]]!r})")
    unexpected = sorted(set(tensors.entries) - set(names.values()))
    if unexpected:
        raise WeightError(
            f"{tensors.file}: unexpected tensor {unexpected[0]!r} (not part of a {model.config.architecture})"
        )
    targets = checkpoint_targets(model)
    for hf_name, target in targets.items():  # first: undoing the conversion and joining shards assume the shapes
        gguf_name = names[hf_name]
        shape = tuple(tensors.entries[gguf_name]["shape"])
        if shape != target.shape and not model.skips_weight(hf_name):
            where = f"{tensors.file}: tensor {gguf_name!r} (for {hf_name!r})"
            raise WeightError(f"{where} has shape {shape}, expected {target.shape}")
    quantized = _quantized_projections(model, targets, names, tensors)
    for module, _ in quantized:
        del module.weight  # never allocated: the file's quantized data replaces it
    model = materialize_on_huge_pages(model)
    model.build_rotary(torch.device("cpu"))
    targets = checkpoint_targets(model)  # the materialized parameters
    planned = {hf for _, shards in quantized for hf, _ in shards}
    for hf_name, target in targets.items():
        if hf_name in planned or model.skips_weight(hf_name):
            continue
        weight = tensors.read(names[hf_name])
        if isinstance(weight, QuantizedTensors):
            weight = dequantize(weight)
        weight = _undo_conversion(weight, hf_name, model, tensors.architecture)
        check_tensor(model, targets, hf_name, weight, str(tensors.file))
        target.load(weight)
    for module, shards in quantized:
        parts = [_undo_conversion(tensors.read(names[hf]), hf, model, tensors.architecture) for hf, _ in shards]
        whole = _joined([p for p in parts if isinstance(p, QuantizedTensors)])
        scheme = QuantScheme(whole.bits, whole.group, symmetric=whole.min is None)
        module.load_quantized_(whole, scheme, keeps_panels(model, module))
    modules = [module for module, _ in quantized]
    if modules:
        move_to_huge_pages([b for m in modules for b in m.buffers(recurse=False)])
        model.quantization = modules[0].quantization
    model.checkpoint_quantization = "gguf"
    types = Counter(tensors.qtype(names[hf]).name for hf in names if hf not in planned)
    logger.info(
        "GGUF %s: %d projections kept quantized (kernels: %s); dequantized to %s: %s",
        tensors.file.name,
        len(modules),
        kernels_per_shape(modules) or "none",
        str(next(model.parameters()).dtype).removeprefix("torch."),
        ", ".join(f"{n} {t}" for t, n in sorted(types.items())),
    )


def _gguf_names(model: CausalLM, tensors: GGUFTensors) -> dict[str, str]:
    """Each checkpoint tensor name ``model`` expects -> its GGUF name."""
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == tensors.architecture)
    table = get_tensor_name_map(arch, model.config.num_layers)
    names = {}
    for hf_name in checkpoint_targets(model):
        if hf_name == "lm_head.weight" and tensors.tied_output:
            names[hf_name] = TIED_OUTPUT
            continue
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise WeightError(f"{tensors.file}: the GGUF name of {hf_name!r} is unknown to the gguf package")
        names[hf_name] = gguf_name
    return names


def _quantized_projections(
    model: CausalLM, targets: dict[str, WeightTarget], names: dict[str, str], tensors: GGUFTensors
) -> list[tuple[Linear, list[tuple[str, WeightTarget]]]]:
    """The projections (decoder-layer ones and the LM head) whose file tensors all have one lossless
    type's bit width, with their shards in row order."""
    modules = {
        id(module.weight): module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rpartition(".")[2] != ROUTER_NAME and "weight" in module._parameters
    }
    shards: dict[int, list[tuple[str, WeightTarget]]] = {}
    for hf_name, target in targets.items():
        if hf_name.endswith(".weight") and id(target.param) in modules:
            shards.setdefault(id(target.param), []).append((hf_name, target))
    plans = []
    for key, parts in shards.items():
        types = {tensors.qtype(names[hf]) for hf, _ in parts}
        if types & PANELS_ONLY and not keeps_panels(model, modules[key], torch.device("cpu")):  # it loads on CPU
            continue
        if types <= LOSSLESS_BITS.keys() and len({LOSSLESS_BITS[t] for t in types}) == 1:
            parts.sort(key=lambda part: part[1].index[0].start if part[1].index else 0)
            plans.append((modules[key], parts))
    return plans


def _joined(parts: list[QuantizedTensors]) -> QuantizedTensors:
    """Quantized shards of one bit width stacked in row order; int8 shards in groups of different
    sizes (16 and 32) are joined at the smallest, each scale repeated over its group's halves."""
    group = min(p.group for p in parts)
    scales = [p.scale.repeat_interleave(p.group // group, dim=1) for p in parts]
    return QuantizedTensors(
        torch.cat([p.qweight for p in parts]),
        torch.cat(scales),
        None if parts[0].min is None else torch.cat([p.min for p in parts]),
        parts[0].bits,
        group,
    )


def _undo_conversion(
    weight: torch.Tensor | QuantizedTensors, hf_name: str, model: CausalLM, arch: str
) -> torch.Tensor | QuantizedTensors:
    """``weight`` as the Hugging Face checkpoint stores it (see the module docstring)."""
    config = model.config
    if arch == "llama" and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
        n = weight.shape[0]
        order = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
        if isinstance(weight, QuantizedTensors):
            mins = None if weight.min is None else weight.min[order]
            return QuantizedTensors(weight.qweight[order], weight.scale[order], mins, weight.bits, weight.group)
        return weight[order]
    if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
        return weight - 1
    return weight
