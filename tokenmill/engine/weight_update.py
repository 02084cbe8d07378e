"""Validated, all-or-nothing weight updates from (name, tensor) pairs or a safetensors folder.

``plan_update`` checks every name, shape and dtype against the model before anything is
touched (on the caller's thread); ``apply_update`` copies the tensors in (on the engine thread,
between steps). Checkpoint names are Hugging Face names; fused projections (q/k/v, gate/up) are
updated in the right rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.model.loader import WeightError, check_tensor, copy_tensor, weight_files
from tokenmill.model.transformer import CausalLM, WeightTarget

WeightsSource = Iterable[tuple[str, torch.Tensor]] | str | Path


@dataclass
class PlannedTensor:
    name: str
    target: WeightTarget
    load: Callable[[], torch.Tensor]


def _meta_tensor(shape: list[int], dtype_name: str) -> torch.Tensor:
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    return torch.empty(shape, dtype=dtypes.get(dtype_name, torch.int64), device="meta")


def plan_update(model: CausalLM, weights: WeightsSource) -> list[PlannedTensor]:
    """Validate everything; raise :class:`WeightError` naming the first bad tensor, touching nothing."""
    targets = model.checkpoint_targets()
    planned: list[PlannedTensor] = []
    if isinstance(weights, (str, Path)):
        for file in weight_files(weights):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    sliced = handle.get_slice(name)
                    meta = _meta_tensor(sliced.get_shape(), sliced.get_dtype())
                    target = check_tensor(model, targets, name, meta, str(file))
                    if target is not None:
                        planned.append(PlannedTensor(name, target, _file_loader(file, name)))
        return planned
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise WeightError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        target = check_tensor(model, targets, name, tensor, "update")
        if target is not None:
            planned.append(PlannedTensor(name, target, lambda t=tensor: t))
    if not planned:
        raise WeightError("the update contains no weights of this model")
    return planned


def _file_loader(file: Path, name: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    return load


def apply_update(model: CausalLM, planned: list[PlannedTensor]) -> None:
    """Copy validated tensors into the model (call only between forwards)."""
    for item in planned:
        copy_tensor(model, item.target, item.load())
