"""Checkpoint tensor names -> the parameter rows they load into, and the checks every load passes.

The mapping is derived, never written by hand: every parameter loads from its own Hugging Face
name, except the shards of a :class:`~tokenmill.model.blocks.PackedLinear`, which load from the
names the family's ``packed_modules`` gives them (``q_proj`` -> shard 0 of ``qkv_proj``, ...),
into the rows the packed module reports, and the parameters of a module that lists its own
checkpoint tensors (``checkpoint_shards``: experts, one tensor per expert and projection), its
submodules' included.
With tensor parallelism a target holds its rank's part of the tensor (``parallel.CheckpointPart``):
the loader reads only that part from the file, a weight update stages only that part.
A family whose checkpoint names a module differently (Mixtral's ``block_sparse_moe`` for ``mlp``)
says so in ``checkpoint_module_names``. The loader and weight updates validate through
:func:`check_tensor`, so a tensor is accepted or refused the same way by both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.model.blocks import PackedLinear
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.moe import CheckpointShards
from tokenmill.model.parallel import CheckpointPart, checkpoint_part, param_rows

CHECKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes a checkpoint tensor or weight update may have (float8 and others: no finiteness check, refused)."""


class WeightError(ValueError):
    """A checkpoint tensor that is missing, unexpected, or not a valid value for its parameter."""


@dataclass(frozen=True)
class WeightTarget:
    """``param[index]``: where one checkpoint tensor is stored (all of it, rows of it, or one
    expert's slice of a stacked parameter), or with tensor parallelism where this rank's ``part``
    of it is stored (None: all of it)."""

    param: nn.Parameter
    index: tuple[int | slice, ...] = ()
    part: CheckpointPart | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the checkpoint tensor must have."""
        return self.part_shape if self.part is None else self.part.shape

    @property
    def part_shape(self) -> tuple[int, ...]:
        """The shape of the part of the checkpoint tensor stored here (:attr:`shape` at tp=1)."""
        return tuple(self.param[self.index].shape)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the whole checkpoint ``tensor`` stored here (a view)."""
        return tensor if self.part is None else tensor[self.part.index]

    def load(self, part: torch.Tensor) -> None:
        """Copy the part (:meth:`take`) of a tensor that passed :func:`check_tensor` into its place
        (converted to the parameter's dtype and device on the way; with a tensor from :meth:`stage`,
        a plain copy that cannot fail)."""
        with torch.no_grad():
            self.param[self.index].copy_(part)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of this target's part of ``tensor`` (which passed :func:`check_tensor`) in fresh
        contiguous memory, in the parameter's dtype and on its device: what :meth:`load` then copies
        from as is. Shares no memory with ``tensor`` (nor with the file a safetensors tensor maps)."""
        staged = torch.empty(self.part_shape, dtype=self.param.dtype, device=self.param.device)
        with torch.no_grad():
            staged.copy_(self.take(tensor))
        return staged


def checkpoint_targets(model: CausalLM) -> dict[str, WeightTarget]:
    """Every checkpoint tensor name ``model`` expects -> where it is stored."""
    shards: dict[str, list[tuple[int, str]]] = {}
    for name, (packed, shard) in model.packed_modules.items():
        shards.setdefault(packed, []).append((shard, name))
    renamed = model.checkpoint_module_names
    targets: dict[str, WeightTarget] = {}
    listed: tuple[str, ...] = ()  # prefixes of the modules that list their own tensors, submodules' included
    for path, module in model.named_modules():
        if path.startswith(listed):
            continue
        module_name = ".".join(renamed.get(part, part) for part in path.split(".")) if path else ""
        parent, _, local = module_name.rpartition(".")
        if isinstance(module, CheckpointShards):
            listed += (f"{path}.",)
            for name, param, index, part in module.checkpoint_shards():
                targets[_join(module_name, name)] = WeightTarget(param, index, part)
            continue
        packed = shards.get(local) if isinstance(module, PackedLinear) else None
        if packed is not None and sorted(s for s, _ in packed) != list(range(len(module.shard_sizes))):
            raise ValueError(f"{type(model).__name__}.packed_modules does not name each shard of {module_name} once")
        for leaf, param in module.named_parameters(recurse=False):
            if packed is None:
                targets[_join(module_name, leaf)] = WeightTarget(
                    param, param_rows(module), checkpoint_part(module, leaf)
                )
            else:
                for shard, name in packed:
                    part = module.shard_part(shard, leaf)
                    targets[_join(parent, name, leaf)] = WeightTarget(param, (module.shard_rows(shard),), part)
    return targets


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def check_tensor(
    model: CausalLM,
    targets: dict[str, WeightTarget],
    name: str,
    tensor: torch.Tensor,
    source: str,
    whole_shape: tuple[int, ...] | None = None,
) -> WeightTarget | None:
    """Where checkpoint tensor ``name`` goes; None for tensors to skip.

    ``tensor`` is the whole checkpoint tensor, or only the target's part of it when ``whole_shape``
    (the whole tensor's shape, read from the file's header) is given. Raises :class:`WeightError`
    naming ``source`` and the tensor unless the name is expected and ``tensor`` holds readable data
    in the plain layout (dense and strided: not sparse, quantized, nested or on the meta device; on
    the CPU or the parameter's kind of device), has exactly the target's shape (no broadcasting;
    the whole shape and the part's), a dtype of :data:`CHECKABLE_DTYPES`, and finite values only.
    """
    if model.skips_weight(name):
        return None
    target = targets.get(name)
    if target is None:
        raise WeightError(f"{source}: unexpected tensor {name!r} (not part of a {model.config.architecture})")
    where = f"{source}: tensor {name!r}"
    if tensor.is_meta or tensor.device.type not in ("cpu", target.param.device.type):
        raise WeightError(f"{where} is on device {tensor.device}, expected real data on the CPU or the model's device")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        kind = "quantized" if tensor.is_quantized else "nested" if tensor.is_nested else str(tensor.layout)
        raise WeightError(f"{where} is {kind}, expected a dense strided tensor")
    shape = tuple(tensor.shape) if whole_shape is None else tuple(whole_shape)
    if shape != target.shape:
        raise WeightError(f"{where} has shape {shape}, expected {target.shape}")
    if whole_shape is not None and tuple(tensor.shape) != target.part_shape:
        raise WeightError(f"{where}: its part has shape {tuple(tensor.shape)}, expected {target.part_shape}")
    if tensor.dtype not in CHECKABLE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in CHECKABLE_DTYPES)
        raise WeightError(f"{where} has dtype {str(tensor.dtype).removeprefix('torch.')}, expected one of {names}")
    check_finite(tensor, where)
    return target


def stage_tensor(
    model: CausalLM, targets: dict[str, WeightTarget], name: str, tensor: torch.Tensor, source: str
) -> tuple[WeightTarget, torch.Tensor] | None:
    """``(target, staged part)`` of the whole checkpoint ``tensor``: :func:`check_tensor`, then
    :meth:`WeightTarget.stage`, its result checked finite again when converted to the parameter's
    dtype (a value may overflow a narrower one); None for tensors to skip. Raises :class:`WeightError`."""
    target = check_tensor(model, targets, name, tensor, source)
    if target is None:
        return None
    staged = target.stage(tensor)
    if staged.dtype != tensor.dtype:
        check_finite(staged, f"{source}: tensor {name!r} converted to {staged.dtype}")
    return target, staged


def check_finite(tensor: torch.Tensor, where: str) -> None:
    """Raise :class:`WeightError` (message starting with ``where``) if ``tensor`` holds a NaN or an infinity."""
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        n_bad = finite.numel() - int(finite.sum())
        raise WeightError(f"{where} holds {n_bad} non-finite value(s) (NaN or infinity)")


def check_complete(targets: dict[str, WeightTarget], loaded: set[str]) -> None:
    """Raise :class:`WeightError` listing the expected names that are not in ``loaded``."""
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
