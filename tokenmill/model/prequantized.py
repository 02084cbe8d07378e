"""Pre-quantized Hugging Face checkpoints, loaded as published and repacked once into tokenmill's
in-memory layout (``kernels/quant_format.py``).

``config.json``'s ``quantization_config`` names the format (``quant_method``): ``"awq"``
(``prequant_awq.py``), ``"gptq"`` (``prequant_gptq.py``) or ``"compressed-tensors"``
(``prequant_compressed.py``); any other method, or a field value a format does not support, is a
:class:`ModelConfigError` naming it. :func:`plan_prequantized` then decides, on the meta-device
model, which decoder-layer projections the checkpoint stores quantized (by their tensors; the
shards of a packed projection all or none), drops their ``weight`` parameters so they are never
allocated, and refuses quantized tensors of any other module (LM head, embeddings, MoE experts).
After the other tensors are loaded as usual, :meth:`PrequantizedPlan.load` reads each projection,
checks it against the config (a :class:`WeightError` naming the tensor), takes this rank's part
(rows for column-parallel shards; whole groups of K for row-parallel ones), stacks the shards of a
packed projection (quantized alike) and installs it with ``Linear.load_quantized_``. The model's
``quantization`` is then set, so it is served and refused weight updates like one quantized at load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfigError, read_config_json
from tokenmill.model.huge_pages import move_to_huge_pages
from tokenmill.model.prequant_awq import AwqFormat
from tokenmill.model.prequant_compressed import CompressedTensorsFormat
from tokenmill.model.prequant_format import CheckpointFormat, CheckpointTensors, concat_rows
from tokenmill.model.prequant_gptq import GptqFormat
from tokenmill.model.quantization import ROUTER_NAME, keeps_panels, kernels_per_shape
from tokenmill.model.weights import WeightError, WeightTarget, checkpoint_targets

logger = logging.getLogger("tokenmill.model")

FORMATS: dict[str, type[CheckpointFormat]] = {
    fmt.method: fmt for fmt in (AwqFormat, GptqFormat, CompressedTensorsFormat)
}


def checkpoint_format(path: str | Path) -> CheckpointFormat | None:
    """The format of the pre-quantized checkpoint ``path`` (None: its weights are not quantized)."""
    raw, source = read_config_json(path)
    config = raw.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    fmt = FORMATS.get(method) if isinstance(method, str) else None
    if fmt is None:
        raise ModelConfigError(
            f"{source}: quantization_config quant_method {method!r} is not supported (supported: {', '.join(FORMATS)})"
        )
    try:
        return fmt(config)
    except ValueError as exc:
        raise ModelConfigError(f"{source}: {exc}") from None


@dataclass
class QuantizedProjection:
    """A projection stored quantized: its checkpoint shards (name prefix and where their rows go,
    in row order) and the scheme they share."""

    module: Linear
    shards: list[tuple[str, WeightTarget]]
    scheme: QuantScheme


@dataclass
class PrequantizedPlan:
    """The quantized projections of a checkpoint and how to read them."""

    fmt: CheckpointFormat
    tensors: CheckpointTensors
    projections: list[QuantizedProjection]

    @property
    def tensor_names(self) -> set[str]:
        """The checkpoint tensors the plan reads (the loader skips them)."""
        names = (name for p in self.projections for prefix, _ in p.shards for name in self.fmt.tensor_names(prefix))
        return {name for name in names if name in self.tensors}

    def load(self, model: CausalLM) -> None:
        """Read, repack and install every planned projection (on the device of the model's other
        weights); sets ``model.quantization``."""
        device = next(model.parameters()).device
        for projection in self.projections:
            parts = []
            for prefix, target in projection.shards:
                weight = self.fmt.read(prefix, self.tensors)
                if tuple(weight.q.shape) != target.shape:
                    raise WeightError(
                        f"tensor {weight.name!r} holds a weight of shape {tuple(weight.q.shape)}, "
                        f"expected {target.shape}"
                    )
                rows, cols = (*target.part.index, slice(None))[:2] if target.part is not None else (slice(None),) * 2
                parts.append(weight.take(rows, cols))
            whole = concat_rows(parts)
            whole.check()
            module = projection.module
            module.load_quantized_(whole.to_quantized(device), projection.scheme, keeps_panels(model, module))
        schemes = sorted({p.scheme.name for p in self.projections})
        model.quantization = self.projections[0].scheme
        model.checkpoint_quantization = self.fmt.method
        if device.type == "cpu":
            move_to_huge_pages([b for p in self.projections for b in p.module.buffers(recurse=False)])
        logger.info(
            "loaded %d projections pre-quantized (%s, %s), repacked to tokenmill's layout; kernels: %s",
            len(self.projections),
            self.fmt.method,
            ", ".join(schemes),
            kernels_per_shape([p.module for p in self.projections]),
        )


def plan_prequantized(model: CausalLM, fmt: CheckpointFormat, files: list[Path]) -> PrequantizedPlan:
    """Which projections of ``model`` (built on the meta device, not yet materialized) the checkpoint
    ``files`` store quantized in format ``fmt``; their ``weight`` parameters are dropped. Raises
    :class:`WeightError` for quantized tensors of a module that cannot hold them, a packed
    projection stored partly quantized, or a checkpoint with no quantized projection."""
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            index.update((name, file) for name in handle.keys())
    tensors = CheckpointTensors(index)
    projections = [p for p in _projections(model, fmt, tensors) if p is not None]
    if not projections:
        raise WeightError(f"config.json says {fmt.method}, but no decoder-layer projection is stored quantized")
    plan = PrequantizedPlan(fmt, tensors, projections)
    planned = plan.tensor_names
    leaves = set(fmt.leaves)
    stray = sorted(name for name in index if name.rpartition(".")[2] in leaves and name not in planned)
    if stray:
        raise WeightError(
            f"tensor {stray[0]!r} is quantized ({fmt.method}), but tokenmill loads quantized weights only "
            f"into decoder-layer projections (not the LM head, embeddings, routers or MoE experts)"
            + (f"; {len(stray) - 1} more such tensor(s)" if len(stray) > 1 else "")
        )
    for projection in projections:
        del projection.module.weight  # never allocated: the quantized tensors replace it
    return plan


def _projections(
    model: CausalLM, fmt: CheckpointFormat, tensors: CheckpointTensors
) -> list[QuantizedProjection | None]:
    """Each decoder-layer projection's plan (None: stored unquantized)."""
    modules = {
        id(module.weight): module
        for name, module in model.model.layers.named_modules()
        if isinstance(module, Linear) and name.rpartition(".")[2] != ROUTER_NAME
    }
    shards: dict[int, list[tuple[str, WeightTarget]]] = {}
    for name, target in checkpoint_targets(model).items():
        if name.endswith(".weight") and id(target.param) in modules:
            shards.setdefault(id(target.param), []).append((name.removesuffix(".weight"), target))
    plans: list[QuantizedProjection | None] = []
    for key, parts in shards.items():
        parts.sort(key=lambda part: part[1].index[0].start if part[1].index else 0)
        quantized = [prefix for prefix, _ in parts if fmt.is_quantized(prefix, tensors)]
        if not quantized:
            plans.append(None)
            continue
        if len(quantized) != len(parts):
            plain = [prefix for prefix, _ in parts if prefix not in quantized]
            raise WeightError(
                f"{', '.join(quantized)} stored quantized but {', '.join(plain)} not: they are packed into one "
                "projection and must be stored alike"
            )
        schemes = {fmt.scheme(prefix) for prefix in quantized}
        if len(schemes) > 1:
            raise WeightError(
                f"{', '.join(quantized)} are packed into one projection but quantized differently "
                f"({', '.join(sorted(s.name for s in schemes))})"
            )
        plans.append(QuantizedProjection(modules[key], parts, schemes.pop()))
    return plans
