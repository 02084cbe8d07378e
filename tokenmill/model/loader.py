"""Load a Hugging Face safetensors checkpoint into its family's :class:`CausalLM`.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints.
The model is built on the meta device and materialized empty (on CPU: its parameters in one
huge-page mapping, ``huge_pages.py``), then each tensor is read from disk, checked
(``weights.check_tensor``) and copied straight into its rows of its (possibly packed) parameter,
so at most one checkpoint tensor is held beside the model; every expected tensor must appear.
With tensor parallelism each rank reads only its parts of the tensors (safetensors ``get_slice``).
A pre-quantized checkpoint (``quantization_config`` in config.json) keeps its quantized projections
quantized: they are never allocated in full precision but read and repacked by ``prequantized.py``.
A converted GGUF folder (``gguf_checkpoint.py``) loads from its GGUF file instead (``gguf_loader.py``).
Only safetensors and GGUF are read: no pickle, no remote code.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.gguf_checkpoint import read_index
from tokenmill.model import parallel
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.gguf_loader import load_gguf
from tokenmill.model.huge_pages import materialize_on_huge_pages
from tokenmill.model.prequantized import checkpoint_format, plan_prequantized
from tokenmill.model.registry import load_model_config, model_class
from tokenmill.model.weights import WeightError, WeightTarget, check_complete, check_tensor, checkpoint_targets

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


def iter_checkpoint(
    path: str | Path, targets: dict[str, WeightTarget] | None = None, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor, Path, tuple[int, ...] | None]]:
    """Yield ``(name, tensor, file, whole_shape)`` for every tensor of the checkpoint but those in
    ``skip``, one at a time: the whole tensor (``whole_shape`` None), or for a name of ``targets`` that
    holds a part of its tensor (tensor parallelism) only that part, read from the file, with the
    whole tensor's shape."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name in skip:
                    continue
                target = None if targets is None else targets.get(name)
                if target is not None and target.part is not None:
                    stored = handle.get_slice(name)
                    shape = tuple(stored.get_shape())
                    if shape == target.shape:  # else the whole tensor, for check_tensor to refuse
                        yield name, stored[target.part.index], file, shape
                        continue
                yield name, handle.get_tensor(name), file, None


def load_weights(
    model: CausalLM,
    tensors: Iterable[tuple[str, torch.Tensor, str, tuple[int, ...] | None]],
    targets: dict[str, WeightTarget] | None = None,
) -> None:
    """Stream ``(name, tensor, source, whole_shape)`` (see :func:`check_tensor`) into ``model``;
    every expected tensor must appear."""
    targets = checkpoint_targets(model) if targets is None else targets
    loaded: set[str] = set()
    for name, tensor, source, whole_shape in tensors:
        target = check_tensor(model, targets, name, tensor, source, whole_shape)
        if target is not None:
            target.load(tensor if whole_shape is not None else target.take(tensor))
            loaded.add(name)
    check_complete(targets, loaded)


def check_shardable(path: str | Path, tp: parallel.TensorParallel) -> None:
    """Raise ValueError unless the model of ``path`` splits over ``tp`` (its family supports it, its
    heads and widths divide): the model is built on the meta device, nothing is allocated."""
    config = load_model_config(path)
    with torch.device("meta"), parallel.building(tp):
        model_class(config.architecture)(config)


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, tp: parallel.TensorParallel = parallel.SINGLE
) -> CausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights (with
    tensor parallelism ``tp``: this rank's shards, read from the files part by part)."""
    config = load_model_config(path)
    gguf_index = read_index(path)
    if gguf_index is not None:
        if tp.size > 1 or torch.device(device).type != "cpu":
            raise ValueError("GGUF files load on the CPU, without tensor parallelism")
        with torch.device("meta"):
            model = model_class(config.architecture)(config).to(dtype)
        load_gguf(model, gguf_index)
        return model.eval()
    files = weight_files(path)  # fail on a missing checkpoint before allocating the model
    fmt = checkpoint_format(path)
    with torch.device("meta"), parallel.building(tp):
        model = model_class(config.architecture)(config)
    model = model.to(dtype)
    plan = None if fmt is None else plan_prequantized(model, fmt, files)  # drops the quantized weights
    model = materialize_on_huge_pages(model) if torch.device(device).type == "cpu" else model.to_empty(device=device)
    model.build_rotary(device)
    targets = checkpoint_targets(model)
    skip = set() if plan is None else plan.tensor_names
    tensors = ((name, tensor, str(file), shape) for name, tensor, file, shape in iter_checkpoint(path, targets, skip))
    load_weights(model, tensors, targets)
    if plan is not None:
        plan.load(model)
    return model.eval()
