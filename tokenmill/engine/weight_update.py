"""Validated, all-or-nothing weight updates from (name, tensor) pairs or a safetensors folder.

``plan_update`` checks every name, shape and dtype against the model before anything is
touched (on the caller's thread), with the loader's own checks (``model/weights.py``);
``apply_update`` copies the tensors in place (on the engine thread, between steps), so the
parameters keep their storage. Names are Hugging Face checkpoint names; a tensor of a packed
projection (q/k/v, gate/up) updates its rows only. An update may name any subset of the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.loader import weight_files
from tokenmill.model.weights import WeightError, WeightTarget, check_tensor, checkpoint_targets

WeightsSource = Iterable[tuple[str, torch.Tensor]] | str | Path

SAFETENSORS_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
"""safetensors dtype codes -> torch dtypes, to check a file's tensors before reading them."""


@dataclass
class PlannedTensor:
    """A validated tensor of an update: its name, where it goes, and how to read it."""

    name: str
    target: WeightTarget
    read: Callable[[], torch.Tensor]


def plan_update(model: CausalLM, weights: WeightsSource) -> list[PlannedTensor]:
    """Validate everything; raise :class:`WeightError` naming the first bad tensor, touching nothing."""
    targets = checkpoint_targets(model)
    planned: list[PlannedTensor] = []
    if isinstance(weights, (str, Path)):
        for file in weight_files(weights):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    sliced = handle.get_slice(name)
                    dtype = SAFETENSORS_FLOAT_DTYPES.get(sliced.get_dtype(), torch.int64)  # int64: not a float
                    meta = torch.empty(sliced.get_shape(), dtype=dtype, device="meta")
                    target = check_tensor(model, targets, name, meta, str(file))
                    if target is not None:
                        planned.append(PlannedTensor(name, target, _file_reader(file, name)))
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


def _file_reader(file: Path, name: str) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    return read


def apply_update(planned: list[PlannedTensor]) -> None:
    """Copy validated tensors into the model (call only between forwards)."""
    for item in planned:
        item.target.load(item.read())
