"""LoRA adapters on a model: PEFT adapter folders read and checked against the model, and the
model's adapter slots, ``max_loras`` adapters at once, that its projections compute with.

An adapter (:class:`LoRAAdapter`) is what a PEFT ``save_pretrained`` folder holds
(``adapter_config.json`` + ``adapter_model.safetensors``), checked before anything changes: every
tensor names a decoder projection the model has (``q_proj`` ... ``down_proj``, or a checkpoint's
fused name such as Phi-3's ``qkv_proj``; mapped through the family's ``packed_modules`` and
``checkpoint_module_names`` as its base weights are), has the projection's shapes, a rank of at most
``max_lora_rank`` and finite values. Scaling is ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``), per
module where ``rank_pattern`` / ``alpha_pattern`` say so. Refused with :class:`LoRAError`: DoRA,
trained biases, ``modules_to_save``, embedding or LM-head adapters, ``fan_in_fan_out``.

:class:`LoRASlots` gives each decoder projection of the model its
:class:`~tokenmill.kernels.lora.LoRAWeights` (a packed projection one segment per shard), loads an
adapter into a slot and binds a step's :class:`~tokenmill.kernels.lora.LoRABatch` for one forward.
An adapter is checked and held whole (the checkpoint's shapes); with tensor parallelism each rank's
slots take its part, as its base weights do: B's rows of a column-parallel projection's block (q/k/v,
gate/up), A's columns of a row-parallel one's input block (o, down: the partial deltas are summed
by the projection's all-reduce with its partial products).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tokenmill.kernels.linear import Linear
from tokenmill.kernels.lora import LoRABatch, LoRABinding, LoRAWeights
from tokenmill.model.blocks import PackedLinear
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.parallel import CheckpointParts
from tokenmill.model.weights import CHECKABLE_DTYPES, check_finite

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""The projections of each decoder layer that adapters may change (what every family's layer has;
a MoE layer's experts are not among them)."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_REFUSED_SETTINGS = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts)",
    "layers_pattern": "layers_pattern",
}


class LoRAError(ValueError):
    """An adapter that does not fit the model or the engine's LoRA limits."""


@dataclass(frozen=True)
class ModuleDelta:
    """One projection's adapter matrices: ``delta = x @ a.T @ b.T * scaling`` on ``segment``'s
    output columns (None: all of them)."""

    linear_path: str  # the model's projection (e.g. ``model.layers.0.self_attn.qkv_proj``)
    segment: int | None  # its shard; None for a target that names the whole projection
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [cols, r]
    scaling: float


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: its matrices per projection, as read (host memory)."""

    name: str
    rank: int  # the largest of its modules' ranks
    settings: dict[str, Any]  # adapter_config.json
    deltas: dict[str, ModuleDelta]  # PEFT module name (``model.layers.0.self_attn.q_proj``) -> its matrices
    source: str

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.deltas.values() for t in (d.a, d.b))


def read_adapter(model: CausalLM, name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """The PEFT adapter folder ``path`` checked against ``model`` (raises :class:`LoRAError`)."""
    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no {CONFIG_FILE} (a PEFT adapter folder is expected)")
    if not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {config_file} is not readable JSON: {exc}") from exc
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file} is not a readable safetensors file: {exc}") from exc
    return check_adapter(model, name, settings, tensors, max_rank, str(folder))


def check_adapter(
    model: CausalLM,
    name: str,
    settings: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    max_rank: int,
    source: str,
) -> LoRAAdapter:
    """An adapter from its ``adapter_config.json`` settings and its tensors (PEFT's names), every
    check of the module docstring passed (raises :class:`LoRAError` naming the adapter and what is wrong)."""
    where = f"LoRA adapter {name!r} ({source})"
    if not isinstance(settings, dict) or str(settings.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{where}: adapter_config.json must describe a LORA adapter (peft_type LORA)")
    for key, what in _REFUSED_SETTINGS.items():
        if settings.get(key):
            raise LoRAError(f"{where}: {what} are not supported")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"{where}: trained biases (bias={settings['bias']!r}) are not supported; only bias 'none'")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key)
        if match is None:
            raise LoRAError(f"{where}: unexpected tensor {key!r} (only lora_A / lora_B weights are read)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    if not pairs:
        raise LoRAError(f"{where}: the adapter holds no lora_A / lora_B tensors")
    deltas: dict[str, ModuleDelta] = {}
    for module_name, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAError(f"{where}: {module_name} has {', '.join(pair)} but not both lora_A and lora_B")
        deltas[module_name] = _module_delta(model, where, settings, module_name, pair, max_rank)
    rank = max(d.a.shape[0] for d in deltas.values())
    return LoRAAdapter(name, rank, dict(settings), deltas, source)


def _module_delta(
    model: CausalLM,
    where: str,
    settings: dict[str, Any],
    module_name: str,
    pair: dict[str, torch.Tensor],
    max_rank: int,
) -> ModuleDelta:
    linear_path, segment = _resolve(model, module_name)
    if linear_path is None:
        raise LoRAError(
            f"{where}: {module_name} is not a projection tokenmill can adapt (q/k/v/o/gate/up/down projections "
            "of the decoder layers; not embeddings, the LM head or MoE experts)"
        )
    linear = model.get_submodule(linear_path)
    columns = _full_segments(linear)
    cols = columns[-1].stop if segment is None else columns[segment].stop - columns[segment].start
    in_features = _full_in_features(linear)
    a, b = pair["lora_A"], pair["lora_B"]
    for tensor, label in ((a, "lora_A"), (b, "lora_B")):
        if tensor.dim() != 2 or tensor.dtype not in CHECKABLE_DTYPES:
            raise LoRAError(f"{where}: {module_name}.{label} must be a 2-d float tensor, got {tuple(tensor.shape)}")
    rank = a.shape[0]
    if rank > max_rank:
        raise LoRAError(f"{where}: {module_name} has rank {rank}, above max_lora_rank {max_rank}")
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (cols, rank):
        raise LoRAError(
            f"{where}: {module_name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model needs "
            f"lora_A ({rank}, {in_features}) and lora_B ({cols}, {rank})"
        )
    expected_rank = _pattern_value(settings.get("rank_pattern") or {}, module_name, settings.get("r", rank))
    if rank != expected_rank:
        raise LoRAError(f"{where}: {module_name} has rank {rank} but adapter_config.json says r={expected_rank}")
    try:
        check_finite(a, f"{where}: {module_name}.lora_A")
        check_finite(b, f"{where}: {module_name}.lora_B")
    except ValueError as exc:
        raise LoRAError(str(exc)) from exc
    alpha = float(_pattern_value(settings.get("alpha_pattern") or {}, module_name, settings.get("lora_alpha", rank)))
    scaling = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
    return ModuleDelta(linear_path, segment, a.float(), b.float(), scaling)


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's per-module override: the value of the first pattern the module's name ends with."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module_name):
            return value
    return default


def _resolve(model: CausalLM, module_name: str) -> tuple[str | None, int | None]:
    """``(projection path, segment)`` that PEFT module ``module_name`` adapts; ``(None, None)``
    for a module that is no adaptable projection."""
    renamed = {checkpoint: module for module, checkpoint in model.checkpoint_module_names.items()}
    parent, _, local = ".".join(renamed.get(p, p) for p in module_name.split(".")).rpartition(".")
    packed = model.packed_modules.get(local)
    path, segment = (f"{parent}.{packed[0]}", packed[1]) if packed is not None else (f"{parent}.{local}", None)
    layer_match = re.fullmatch(r"model\.layers\.\d+\.(.+)", path)
    if layer_match is None or layer_match.group(1) not in PROJECTIONS or _projection(model, path) is None:
        return None, None
    return path, segment


def _projection(model: CausalLM, path: str) -> Linear | None:
    """The projection at ``path``; None where the model has none (a MoE layer's ``mlp``, a layer
    index past the last)."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return module if isinstance(module, Linear) else None


def _segments(linear: Linear) -> list[slice]:
    """The output columns of each of the projection's shards (one for a plain projection), as this
    rank holds them."""
    if isinstance(linear, PackedLinear):
        return [linear.shard_rows(i) for i in range(len(linear.shard_sizes))]
    return [slice(0, linear.out_features)]


def _full_segments(linear: Linear) -> list[slice]:
    """Each shard's output columns in the whole (unsharded) projection: the checkpoint's layout."""
    if isinstance(linear, PackedLinear) and linear.source_rows is not None:
        bounds = [0]
        for size in linear.source_sizes:
            bounds.append(bounds[-1] + size)
        return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return _segments(linear)


def _full_in_features(linear: Linear) -> int:
    part = linear.checkpoint_parts.get("weight") if isinstance(linear, CheckpointParts) else None
    return linear.in_features if part is None else part.shape[1]


def _input_block(linear: Linear) -> slice:
    """The input columns this rank's part of the projection reads (all of them unless row-parallel)."""
    part = linear.checkpoint_parts.get("weight") if isinstance(linear, CheckpointParts) else None
    return slice(None) if part is None else part.index[1]


def _shard_block(linear: Linear, segment: int) -> slice:
    """The rows of shard ``segment``'s whole checkpoint projection that this rank holds."""
    if isinstance(linear, PackedLinear) and linear.source_rows is not None:
        return linear.source_rows[segment]
    return slice(None)


class LoRASlots:
    """The model's adapter slots: :class:`LoRAWeights` on every adaptable projection (their memory
    allocated once, for ``max_loras`` adapters of rank ``max_rank``). Engine thread only."""

    def __init__(self, model: CausalLM, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.binding = LoRABinding()
        self.weights: dict[str, LoRAWeights] = {}
        embed = model.model.embed_tokens.weight
        self.linears: dict[str, Linear] = {}
        for i in range(len(model.model.layers)):
            for projection in PROJECTIONS:
                path = f"model.layers.{i}.{projection}"
                linear = _projection(model, path)
                if linear is not None:
                    self.linears[path] = linear
                    linear.lora = self.weights[path] = LoRAWeights(
                        self.binding,
                        max_loras,
                        max_rank,
                        linear.in_features,
                        _segments(linear),
                        embed.dtype,
                        embed.device,
                    )

    def load(self, slot: int, deltas: Iterable[ModuleDelta]) -> None:
        """Put an adapter's ``deltas`` (``LoRAAdapter.deltas``' values) into ``slot``, this rank's part
        of each; whatever was there is replaced (no deltas: the slot is emptied)."""
        self.clear(slot)
        for delta in deltas:
            weights, linear = self.weights[delta.linear_path], self.linears[delta.linear_path]
            a = delta.a[:, _input_block(linear)]
            if delta.segment is not None:
                b = delta.b[_shard_block(linear, delta.segment)]
                weights.load(slot, delta.segment, a, b, delta.scaling)
                continue
            for j, cols in enumerate(_full_segments(linear)):  # a fused target: its rows split over the shards
                rows = _shard_block(linear, j)
                weights.load(slot, j, a, delta.b[cols][rows], delta.scaling)

    def clear(self, slot: int) -> None:
        for weights in self.weights.values():
            weights.clear(slot)

    def nbytes(self) -> int:
        """Bytes of every slot's matrices."""
        return sum(w.nbytes() for w in self.weights.values())

    @contextlib.contextmanager
    def bound(self, batch: LoRABatch) -> Iterator[None]:
        """The projections add ``batch``'s deltas inside this block (one forward), none after it."""
        self.binding.batch = batch
        try:
            yield
        finally:
            self.binding.batch = None
