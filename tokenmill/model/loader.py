"""Load a Hugging Face safetensors checkpoint into a :class:`CausalLM`.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints.
The model is built on the meta device and materialized empty (on CPU: its parameters in one
huge-page mapping, ``huge_pages.py``), then each tensor is read from disk
and copied straight into its (possibly fused) parameter, so at most one checkpoint tensor is held
beside the model. Only safetensors are read: no pickle, no remote code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.model.config import ModelConfig
from tokenmill.model.huge_pages import materialize_on_huge_pages
from tokenmill.model.layers import RotaryEmbedding
from tokenmill.model.transformer import CausalLM, WeightTarget

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightError(ValueError):
    """A checkpoint tensor that is missing, unexpected, or of the wrong shape or dtype."""


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in a stable order."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (tokenmill reads safetensors checkpoints only)"
    )


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield ``(name, tensor, file)`` for every tensor of the checkpoint, one at a time."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name), file


def check_tensor(
    model: CausalLM, targets: dict[str, WeightTarget], name: str, tensor: torch.Tensor, source: str
) -> WeightTarget | None:
    """Validate one checkpoint tensor against the model; None for tensors to skip.

    Raises :class:`WeightError` naming ``source`` and the tensor for unknown names, wrong shapes
    or non-floating dtypes.
    """
    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
        return None
    target = targets.get(name)
    if target is None:
        raise WeightError(f"{source}: unexpected tensor {name!r} (not part of a {model.config.architecture})")
    param = model.get_parameter(target.param_name)
    expected = (target.n_rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise WeightError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
    if not tensor.is_floating_point():
        raise WeightError(f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point dtype")
    return target


def copy_tensor(model: CausalLM, target: WeightTarget, tensor: torch.Tensor) -> None:
    """Copy a validated tensor into its rows of the target parameter."""
    param = model.get_parameter(target.param_name)
    with torch.no_grad():
        param[target.row_start : target.row_start + target.n_rows].copy_(tensor)


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor, str]]) -> None:
    """Stream ``(name, tensor, source)`` into ``model``; every expected tensor must appear."""
    targets = model.checkpoint_targets()
    loaded: set[str] = set()
    for name, tensor, source in tensors:
        target = check_tensor(model, targets, name, tensor, source)
        if target is not None:
            copy_tensor(model, target, tensor)
            loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights."""
    config = ModelConfig.from_pretrained(path)
    weight_files(path)  # fail on a missing checkpoint before allocating the model
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype)
    model = materialize_on_huge_pages(model) if torch.device(device).type == "cpu" else model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings).to(device)
    load_weights(model, ((name, tensor, str(file)) for name, tensor, file in iter_checkpoint(path)))
    return model.eval()
