"""Validated, all-or-nothing weight updates from (name, tensor) pairs or a safetensors folder.

Two phases. :func:`stage_update` (on the caller's thread, the engine untouched) reads every
tensor, checks it with the loader's own checks (``model/weights.py``: expected name, exact shape,
floating dtype, dense readable data, finite values) and copies it into staging memory already in
its parameter's dtype, device and layout, where it is checked again (a value may overflow the
narrower dtype). A folder's files are read completely here, so rewriting them afterwards changes
nothing. :func:`apply_update` (on the engine thread, between steps) then only copies staged
tensors of identical shape, dtype and device in place, which cannot fail halfway; the parameters
keep their storage (CUDA graphs stay valid). Staging holds one extra copy of the updated weights
until the update is applied. With tensor parallelism rank 0 stages its part and keeps a CPU copy
of each whole tensor: the :class:`WeightsUpdate` that every rank's ``ModelWorker.stage_weights``
receives (each other rank stages its part from the whole tensors), and none applies unless every
rank accepted.

Derived copies of the weights are never stale: a oneDNN blocked copy (``kernels/linear.py``
``BlockedCopy``) is remade on its next use from the weight's version counter, which the in-place
copy moves, and is replaced only once remade. Names are Hugging Face checkpoint names; a tensor
of a packed projection (q/k/v, gate/up) or of one expert updates its rows only; a tied LM head is
the embedding. An update may name any subset of the weights, each at most once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.loader import weight_files
from tokenmill.model.weights import WeightError, WeightTarget, checkpoint_targets, stage_tensor
from tokenmill.request import ParameterError

WeightsSource = Iterable[tuple[str, torch.Tensor]] | str | Path

MAX_WEIGHT_VERSION = 2**63 - 1
"""Weight versions are int64 (they tag every generated token)."""


@dataclass(frozen=True)
class StagedTensor:
    """A validated tensor of an update, in its parameter's dtype, device and shape, and where it goes;
    ``whole``: a CPU copy of the whole checkpoint tensor as given, for the other tensor-parallel ranks
    (None unless staged with ``keep_whole``)."""

    name: str
    target: WeightTarget
    tensor: torch.Tensor
    whole: torch.Tensor | None = None


Manifest = list[tuple[str, torch.dtype, tuple[int, ...]]]
"""An update's tensors as names, dtypes and shapes."""


@dataclass
class WeightsUpdate:
    """An update on its way to every rank. As a call's argument it is pickled with its manifest
    alone; the rank that read it keeps the whole tensors (CPU copies; with tensor parallelism only),
    which :func:`send_whole` streams to the others one tensor at a time, and its staged part."""

    manifest: Manifest
    whole: list[tuple[str, torch.Tensor]] | None = None
    staged: list[StagedTensor] | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"manifest": self.manifest, "whole": None, "staged": None}

    @classmethod
    def of(cls, staged: list[StagedTensor]) -> WeightsUpdate:
        """The update of ``staged`` (whole copies kept where it was staged with ``keep_whole``)."""
        whole = [(item.name, item.whole) for item in staged if item.whole is not None]
        return cls([(name, t.dtype, tuple(t.shape)) for name, t in whole], whole, staged)


def send_whole(whole: list[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """The rank that read an update: broadcast each whole tensor's bytes, in manifest order."""
    for _, tensor in whole:
        data = tensor.contiguous().reshape(-1).view(torch.uint8).to(device)
        if data.numel():
            dist.broadcast(data, src=0)


def receive_whole(manifest: Manifest, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The other ranks: each whole tensor of ``manifest`` as it arrives (drain the iterator even when
    staging stops early: every rank takes part in every broadcast)."""
    for name, dtype, shape in manifest:
        data = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8, device=device)
        if data.numel():
            dist.broadcast(data, src=0)
        yield name, data.view(dtype).view(shape)


def next_version(current: int, requested: int | None) -> int:
    """The version an update moves to: ``requested``, or ``current + 1`` when None.

    Raises :class:`ParameterError` (``version``) unless it is an int (not a bool) in
    ``[0, MAX_WEIGHT_VERSION]`` greater than ``current``.
    """
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
        raise ParameterError("version", f"must be an integer, got {type(requested).__name__}")
    version = current + 1 if requested is None else requested
    if not 0 <= version <= MAX_WEIGHT_VERSION:
        raise ParameterError("version", f"must lie in [0, 2**63 - 1], got {version}")
    if version <= current:
        raise ParameterError("version", f"must increase: {version} <= current {current}")
    return version


def stage_update(model: CausalLM, weights: WeightsSource, keep_whole: bool = False) -> list[StagedTensor]:
    """Read, validate and stage every tensor of ``weights``; raise :class:`WeightError` naming the
    first bad tensor (nothing of the model is touched either way). ``keep_whole``: also keep a CPU
    copy of each whole tensor (:attr:`StagedTensor.whole`; with tensor parallelism, for the workers).
    A quantized model refuses every update (its projections hold no full-precision weights to update)."""
    if model.quantization is not None:
        raise WeightError(
            f"this model's projections are quantized ({model.quantization.name}) and cannot be updated; "
            "start the engine without quantization to update weights"
        )
    targets = checkpoint_targets(model)
    staged: dict[str, StagedTensor] = {}
    for name, tensor, source in _read(weights):
        if name in staged:
            raise WeightError(f"{source}: tensor {name!r} appears more than once in the update")
        target_and_copy = stage_tensor(model, targets, name, tensor, source)
        if target_and_copy is None:
            continue
        whole = tensor.detach().to("cpu", copy=True).contiguous() if keep_whole else None
        staged[name] = StagedTensor(name, *target_and_copy, whole)
    if not staged:
        raise WeightError("the update contains no weights of this model")
    return list(staged.values())


def _read(weights: WeightsSource) -> Iterator[tuple[str, torch.Tensor, str]]:
    """``(name, tensor, source)`` for each tensor of ``weights``; a folder's files one at a time."""
    if isinstance(weights, (str, Path)):
        for file in weight_files(weights):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name), str(file)
        return
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise WeightError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        yield name, tensor, "update"


def apply_update(staged: list[StagedTensor]) -> None:
    """Copy staged tensors into the model (call only between forwards). Each copy is between
    tensors of one shape, dtype and device, so this does not fail partway."""
    for item in staged:
        item.target.load(item.tensor)
