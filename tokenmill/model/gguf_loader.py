"""Load a GGUF file's weights (through its converted folder, ``gguf_checkpoint.py``) into a model.

The file is memory-mapped and every tensor read once. Names map from the model's Hugging Face
checkpoint names through the ``gguf`` package's tensor-name table for the architecture; the LM head
of a file without ``output.weight`` loads from ``token_embd.weight``; MoE experts, which llama.cpp
stores stacked (``blk.N.ffn_gate_exps.weight``, ``ffn_up_exps``, ``ffn_down_exps``: ``[E, N, K]``),
load expert by expert from their slices (``model.layers.N.mlp.experts.<e>.gate_proj.weight`` from
``[e]`` of the table's name for ``model.layers.N.mlp.experts.gate_proj``). Undone on the way, as
``transformers`` undoes them: llama.cpp's rotary permutation of the Q and K rows ("llama"
architecture: rows of each head reordered from halves to interleaved pairs; a row permutation, so
quantized rows are permuted as they are) and Gemma's ``1 +`` folded into its norm weights.

A decoder-layer projection whose tensors are all of a type the quantized kernels run exactly
(``gguf_tensors.LOSSLESS_BITS``), with one bit width, keeps its quantized data (the panels layout
where ``quantization.keeps_panels`` says so; Q6_K's groups of 16 only there; int8 shards with groups
of 16 and of 32 joined at 16); so does an untied LM head, and so does each expert's gate/up and down
projection (the experts then unstacked: ``moe.Experts.unstack_``; routers stay in full precision);
every other tensor is dequantized to the model's dtype, and the start-up log says how many. Every
expected tensor must be in the file, with the expected shape; a missing, unexpected or misshapen one
is a WeightError.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import QuantizedTensors, QuantScheme, dequantize
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.gguf_tensors import LOSSLESS_BITS, PANELS_ONLY, gguf_weight
from tokenmill.model.huge_pages import materialize_on_huge_pages, move_to_huge_pages
from tokenmill.model.moe import Experts
from tokenmill.model.quantization import ROUTER_NAME, keeps_panels, kernels_per_shape
from tokenmill.model.weights import WeightError, WeightTarget, check_tensor, checkpoint_targets

logger = logging.getLogger("tokenmill.model")

TIED_OUTPUT = "token_embd.weight"
EXPERT = re.compile(r"(?P<stack>.+\.experts)\.(?P<expert>\d+)\.(?P<leaf>.+)")
"""A per-expert checkpoint name: its stack's name is ``<stack>.<leaf>``."""


class Source(NamedTuple):
    """Where a checkpoint tensor is in the file: GGUF tensor ``name``, all of it, or (``expert`` not
    None) that expert's ``[N, K]`` of the stacked ``[E, N, K]`` tensor."""

    name: str
    expert: int | None = None


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

    def read(self, source: Source) -> QuantizedTensors | torch.Tensor:
        """The tensor at ``source`` as :func:`gguf_weight` gives it (1-D tensors as fp32 ``[K]``); an
        expert's slice is read alone (its rows of blocks are contiguous in the stack)."""
        entry = self.entries[source.name]
        start, size, shape = entry["offset"], entry["bytes"], entry["shape"]
        if source.expert is not None:
            size //= shape[0]
            start += source.expert * size
            shape = shape[1:]
        rows = (int(np.prod(shape[:-1])), shape[-1])
        try:
            weight = gguf_weight(self._data[start : start + size], self.qtype(source.name), rows)
        except ValueError as exc:
            raise WeightError(f"{self.file}: tensor {source.name!r}: {exc}") from None
        return weight.reshape(shape) if isinstance(weight, torch.Tensor) else weight


def load_gguf(model: CausalLM, index: dict) -> None:
    """Load the file ``index`` describes into ``model`` (built on the meta device, in its dtype, not
    yet materialized), then materialize what is left: see the module docstring."""
    tensors = GGUFTensors(index)
    sources = _sources(model, tensors)
    missing = sorted(hf for hf, source in sources.items() if source.name not in tensors.entries)
    if missing:
        raise WeightError(f"{tensors.file}: no tensor for {missing[0]!r} (GGUF name {sources[missing[0]].name!r})")
    unexpected = sorted(set(tensors.entries) - {source.name for source in sources.values()})
    if unexpected:
        raise WeightError(
            f"{tensors.file}: unexpected tensor {unexpected[0]!r} (not part of a {model.config.architecture})"
        )
    targets = checkpoint_targets(model)
    num_experts = model.config.moe.num_experts if model.config.moe is not None else 0
    for hf_name, target in targets.items():  # first: undoing the conversion and joining shards assume the shapes
        source = sources[hf_name]
        shape = tuple(tensors.entries[source.name]["shape"])
        expected = target.shape if source.expert is None else (num_experts, *target.shape)
        if shape != expected and not model.skips_weight(hf_name):
            where = f"{tensors.file}: tensor {source.name!r} (for {hf_name!r})"
            raise WeightError(f"{where} has shape {shape}, expected {expected}")
    _unstack_quantized_experts(model, targets, sources, tensors)
    targets = checkpoint_targets(model)  # the unstacked experts' layers
    quantized = _quantized_projections(model, targets, sources, tensors)
    for module, _ in quantized:
        del module.weight  # never allocated: the file's quantized data replaces it
    model = materialize_on_huge_pages(model)
    model.build_rotary(torch.device("cpu"))
    targets = checkpoint_targets(model)  # the materialized parameters
    planned = {hf for _, shards in quantized for hf, _ in shards}
    for hf_name, target in targets.items():
        if hf_name in planned or model.skips_weight(hf_name):
            continue
        weight = tensors.read(sources[hf_name])
        if isinstance(weight, QuantizedTensors):
            weight = dequantize(weight)
        weight = _undo_conversion(weight, hf_name, model, tensors.architecture)
        check_tensor(model, targets, hf_name, weight, str(tensors.file))
        target.load(weight)
    for module, shards in quantized:
        parts = [_undo_conversion(tensors.read(sources[hf]), hf, model, tensors.architecture) for hf, _ in shards]
        assert all(isinstance(p, QuantizedTensors) for p in parts), "planned shards are of lossless types"
        whole = _joined(cast(list[QuantizedTensors], parts))
        scheme = QuantScheme(whole.bits, whole.group, symmetric=whole.min is None)
        module.load_quantized_(whole, scheme, keeps_panels(model, module))
    modules = [module for module, _ in quantized]
    if modules:
        move_to_huge_pages([b for m in modules for b in m.buffers(recurse=False)])
        model.quantization = modules[0].quantization
    model.checkpoint_quantization = "gguf"
    types = Counter(tensors.qtype(sources[hf].name).name for hf in sources if hf not in planned)
    logger.info(
        "GGUF %s: %d projections kept quantized (kernels: %s); dequantized to %s: %s",
        tensors.file.name,
        len(modules),
        kernels_per_shape(modules) or "none",
        str(next(model.parameters()).dtype).removeprefix("torch."),
        ", ".join(f"{n} {t}" for t, n in sorted(types.items())),
    )


def _sources(model: CausalLM, tensors: GGUFTensors) -> dict[str, Source]:
    """Each checkpoint tensor name ``model`` expects -> where it is in the file."""
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == tensors.architecture)
    table = get_tensor_name_map(arch, model.config.num_layers)
    sources = {}
    for hf_name in checkpoint_targets(model):
        if hf_name == "lm_head.weight" and tensors.tied_output:
            sources[hf_name] = Source(TIED_OUTPUT)
            continue
        expert = EXPERT.fullmatch(hf_name)
        stack_name = hf_name if expert is None else f"{expert['stack']}.{expert['leaf']}"
        gguf_name = table.get_name(stack_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise WeightError(f"{tensors.file}: the GGUF name of {hf_name!r} is unknown to the gguf package")
        sources[hf_name] = Source(gguf_name, None if expert is None else int(expert["expert"]))
    return sources


def _unstack_quantized_experts(
    model: CausalLM, targets: dict[str, WeightTarget], sources: dict[str, Source], tensors: GGUFTensors
) -> None:
    """Unstack (``Experts.unstack_``) the experts with a stack of a lossless type in the file, so that
    their projections can be kept quantized one by one."""
    files: dict[int, set[str]] = {}  # parameter -> the GGUF tensors it loads from
    for hf_name, target in targets.items():
        files.setdefault(id(target.param), set()).add(sources[hf_name].name)
    for module in list(model.modules()):
        if isinstance(module, Experts) and module.layers is None:
            stacked = files[id(module.gate_up_proj)] | files[id(module.down_proj)]
            if any(tensors.qtype(name) in LOSSLESS_BITS for name in stacked):
                module.unstack_()


def _quantized_projections(
    model: CausalLM, targets: dict[str, WeightTarget], sources: dict[str, Source], tensors: GGUFTensors
) -> list[tuple[Linear, list[tuple[str, WeightTarget]]]]:
    """The projections (decoder-layer ones, unstacked experts' and the LM head) whose file tensors
    all have one lossless type's bit width, with their shards in row order."""
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
        types = {tensors.qtype(sources[hf].name) for hf, _ in parts}
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
