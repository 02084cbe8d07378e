"""Load a Hugging Face safetensors checkpoint into its family's :class:`CausalLM`.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints.
The model is built on the meta device and materialized empty (on CPU: its parameters in one
huge-page mapping, ``huge_pages.py``), then each tensor is read from disk, checked
(``weights.check_tensor``) and copied straight into its rows of its (possibly packed) parameter,
so at most one checkpoint tensor is held beside the model; every expected tensor must appear.
Only safetensors are read: no pickle, no remote code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.huge_pages import materialize_on_huge_pages
from tokenmill.model.registry import load_model_config, model_class
from tokenmill.model.weights import WeightError, check_complete, check_tensor, checkpoint_targets

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor, str]]) -> None:
    """Stream ``(name, tensor, source)`` into ``model``; every expected tensor must appear."""
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    for name, tensor, source in tensors:
        target = check_tensor(model, targets, name, tensor, source)
        if target is not None:
            target.load(tensor)
            loaded.add(name)
    check_complete(targets, loaded)


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights."""
    config = load_model_config(path)
    weight_files(path)  # fail on a missing checkpoint before allocating the model
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    model = model.to(dtype)
    model = materialize_on_huge_pages(model) if torch.device(device).type == "cpu" else model.to_empty(device=device)
    model.build_rotary(device)
    load_weights(model, ((name, tensor, str(file)) for name, tensor, file in iter_checkpoint(path)))
    return model.eval()
