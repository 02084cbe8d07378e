"""Repacked weights kept on disk, so that a model repacked at load starts from them the next time.

A model whose weights are repacked at load (a GGUF file's blocks, a pre-quantized checkpoint's
groups, a checkpoint quantized at load; see ``gguf_loader.py``, ``prequantized.py``,
``quantization.py``) costs seconds to tens of seconds of repacking at every start. After such a load,
:func:`load_repacked` writes the model's tensors as the kernels hold them (parameters, and each
quantized projection's ``qweight`` / ``qscale`` / ``qmin``) to one file under the cache
(``$TOKENMILL_CACHE_DIR``, default ``~/.cache/tokenmill``, then ``repacked/``), with a manifest of
what is not a tensor (which projections are quantized and how, which MoE stacks are unstacked); a
later start of the same model builds the model's skeleton from the manifest and points its tensors
into a private memory map of the file (as llama.cpp maps a GGUF file: no copy, the pages shared
with the page cache, read in at start-up so that the first requests do not fault them in; a write to
a tensor copies its page). The file is in the safetensors format (any safetensors reader can open
it), written by this module because the library refuses tensors that share one mapping; each
tensor starts on a cache line (whole-line tensors first, the header padded), the odd-sized ones
at the end are copied out of the map.

The file's name holds a hash of everything the repacked tensors depend on (:func:`cache_key`): the
source files (path, size, modification time), the dtype, the quantization scheme, the CPU's features
and the ``TOKENMILL_CPU_MARCH`` that pick the layouts, and the source text of the modules that may
repack (every ``model/`` module and ``kernels/quant_format.py``); so a changed file, another CPU or
another tokenmill version misses, and nothing is ever read across them. A file is checked before any
of it is used: its manifest's key must be the one expected, it must hold exactly the tensors the
model needs, each of the expected shape and dtype, laid end to end to the file's last byte; a file
that fails (or cannot be read) is a miss, logged, and the model loads from its source and the file
is written again. Files are written beside their final name and renamed into place; an entry of the
same source made for a since-changed file is removed when the new one is written. The cache is
trusted as the user's own files are (whoever can write it chooses the weights); it holds a copy of
each cached model's weights (``weight_cache=False`` turns it off).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tokenmill.gguf_checkpoint import cache_root, read_index
from tokenmill.hardware import cpu_flags
from tokenmill.kernels import quant_format
from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.kernels.quant_linear import int8_dot_isa
from tokenmill.model import quantization
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.huge_pages import ALIGN_BYTES
from tokenmill.model.loader import load_model, weight_files
from tokenmill.model.moe import Experts
from tokenmill.model.prequantized import checkpoint_format
from tokenmill.model.quantization import quantize_model, untied_head
from tokenmill.model.registry import load_model_config, model_class

logger = logging.getLogger("tokenmill.model")

REPACKING_CODE = (Path(quant_format.__file__ or ""), *sorted(Path(__file__).parent.glob("*.py")))
"""The source files whose code may decide the repacked tensors (every model module and the quantized
format's): their text is part of the key, so any change to them misses."""
QUANTIZED_BUFFERS = ("qweight", "qscale", "qmin")
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
}
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python names it from 3.13


def load_repacked(path: str | Path, dtype: torch.dtype, scheme: QuantScheme | None, enabled: bool = True) -> CausalLM:
    """The model at ``path`` on the CPU in ``dtype``, quantized with ``scheme`` (None: as the checkpoint
    is), from its cache file where there is a good one, else loaded (and cached where it was repacked
    and ``enabled``)."""
    key = cache_key(path, dtype, scheme) if enabled and _repacks(path, scheme) else None
    file = None if key is None else _file(path, key)
    if file is not None and key is not None and file.is_file():
        started = time.perf_counter()
        model = _restore(file, path, dtype, key)
        if model is not None:
            logger.info("repacked weights read from %s in %.1f s", file, time.perf_counter() - started)
            return model
    started = time.perf_counter()
    model = load_model(path, dtype, "cpu")
    if scheme is not None:
        quantize_model(model, scheme)
    if file is not None and key is not None and _repacked(model):
        logger.info(
            "weights loaded and repacked in %.1f s; saving them for later starts", time.perf_counter() - started
        )
        _store(model, file, key)
    return model


def cache_file(path: str | Path, dtype: torch.dtype, scheme: QuantScheme | None) -> Path | None:
    """Where the repacked weights of this load are cached; None for a checkpoint loaded as it is."""
    return _file(path, cache_key(path, dtype, scheme)) if _repacks(path, scheme) else None


def _repacks(path: str | Path, scheme: QuantScheme | None) -> bool:
    """Whether loading ``path`` with ``scheme`` repacks weights (a GGUF file, a pre-quantized checkpoint
    or quantizing at load)."""
    return scheme is not None or read_index(path) is not None or checkpoint_format(path) is not None


def _file(path: str | Path, key: dict[str, Any]) -> Path:
    index = read_index(path)
    source = Path(index["file"]).stem if index is not None else Path(path).resolve().name
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "repacked" / f"{_slug(source)}-{digest}.safetensors"


def cache_key(path: str | Path, dtype: torch.dtype, scheme: QuantScheme | None) -> dict[str, Any]:
    """Everything a load's repacked tensors depend on (see the module docstring)."""
    index = read_index(path)
    sources = [Path(index["file"])] if index is not None else [Path(path) / "config.json", *weight_files(path)]
    code = hashlib.sha256()
    for file in REPACKING_CODE:
        code.update(file.read_bytes())
    return {
        "sources": [_identity(file) for file in sources],
        "dtype": str(dtype),
        "scheme": None if scheme is None else [scheme.bits, scheme.group_size, scheme.symmetric],
        "cpu": {
            "flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
            "march": os.environ.get("TOKENMILL_CPU_MARCH", ""),
            "int8_dot": int8_dot_isa(),
            "panels": quantization.panels_on_cpu(dtype),
        },
        "code": code.hexdigest()[:20],
    }


def _identity(file: Path) -> list[Any]:
    stat = file.stat()
    return [str(file.resolve()), stat.st_size, stat.st_mtime_ns]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:80] or "model"


def _repacked(model: CausalLM) -> bool:
    """Whether ``model`` is a decoder whose weights were repacked (encoders are not cached)."""
    return isinstance(model, CausalLM) and (model.quantization is not None or model.checkpoint_quantization is not None)


def _quantized_layers(model: CausalLM) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.quantization is not None}


def _tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The tensors a cache file holds: every parameter (shared ones once) and each quantized
    projection's buffers."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, layer in _quantized_layers(model).items():
        for buffer in QUANTIZED_BUFFERS:
            value = getattr(layer, buffer)
            if value is not None:
                tensors[f"{name}.{buffer}"] = value
    return tensors


def _manifest(model: CausalLM, key: dict[str, Any]) -> dict[str, Any]:
    def scheme(s: QuantScheme | None) -> list[Any] | None:
        return None if s is None else [s.bits, s.group_size, s.symmetric]

    return {
        "key": key,
        "quantization": scheme(model.quantization),
        "checkpoint_quantization": model.checkpoint_quantization,
        "unstacked": [n for n, m in model.named_modules() if isinstance(m, Experts) and m.layers is not None],
        "quantized": {n: scheme(m.quantization) for n, m in _quantized_layers(model).items()},
    }


def _store(model: CausalLM, file: Path, key: dict[str, Any]) -> None:
    """Write ``model``'s tensors and manifest to ``file`` (safetensors), replacing this source's older
    entries; a failure to write is logged and changes nothing else."""
    started = time.perf_counter()
    unordered = _tensors(model)
    # whole cache lines first, so that every tensor but the odd-sized ones at the end starts on one
    tensors = dict(sorted(unordered.items(), key=lambda item: _nbytes(item[1]) % ALIGN_BYTES != 0))
    header: dict[str, Any] = {"__metadata__": {"manifest": json.dumps(_manifest(model, key))}}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = _nbytes(tensor)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGN_BYTES)  # the data starts on a cache line
    partial = file.with_name(f"{file.name}.{os.getpid()}.partial")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as out:
            out.write(len(encoded).to_bytes(8, "little"))
            out.write(encoded)
            for tensor in tensors.values():
                out.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        partial.rename(file)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        logger.warning("repacked weights not cached (%s): the next start repacks again", exc)
        return
    _remove_stale(file, key)
    logger.info("repacked weights saved to %s (%.0f MB) in %.1f s", file, offset / 2**20, time.perf_counter() - started)


def _remove_stale(file: Path, key: dict[str, Any]) -> None:
    """Remove the entries of ``file``'s source whose source files have changed since."""
    prefix = file.name.rsplit("-", 1)[0] + "-"
    for other in file.parent.glob(f"{prefix}*.safetensors"):
        if other == file:
            continue
        manifest = _read_manifest(other)
        paths = [s[0] for s in key["sources"]]
        if manifest is not None and [s[0] for s in manifest["key"]["sources"]] == paths:
            if manifest["key"]["sources"] != key["sources"]:
                other.unlink(missing_ok=True)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _read_manifest(file: Path) -> dict[str, Any] | None:
    try:
        with open(file, "rb") as stream:
            return json.loads(_read_header(stream)["__metadata__"]["manifest"])
    except Exception:  # noqa: BLE001 (any unreadable file is a miss)
        return None


def _restore(file: Path, path: str | Path, dtype: torch.dtype, key: dict[str, Any]) -> CausalLM | None:
    """The model built from ``file``, or None (logged) where the file is not one for this load."""
    try:
        with open(file, "rb") as stream:
            header = _read_header(stream)
            manifest = json.loads(header.pop("__metadata__")["manifest"])
            if manifest["key"] != key:
                raise ValueError("made for another load")
            model = _skeleton(path, dtype, manifest, header)
            expected = _tensors(model)
            if set(header) != set(expected):
                odd = sorted(set(header) ^ set(expected))
                raise ValueError(f"holds other tensors than the model's ({odd[0]!r})")
            for name, tensor in expected.items():
                stored = header[name]
                shape, kind = tuple(stored["shape"]), stored["dtype"]
                if shape != tuple(tensor.shape) or kind != SAFETENSORS_DTYPES.get(tensor.dtype):
                    raise ValueError(f"tensor {name!r} is {kind} {shape}, expected {tuple(tensor.shape)}")
            return _fill(model, stream, header, manifest)
    except Exception as exc:  # noqa: BLE001 (any bad file is a miss; the model loads from its source)
        logger.warning("repacked weights in %s not used (%s); loading from the source", file, exc)
        return None


def _read_header(stream: BinaryIO) -> dict[str, Any]:
    """A safetensors file's header, each tensor's ``data_offsets`` made absolute and checked to lie
    in the file, one after another."""
    size = int.from_bytes(stream.read(8), "little")
    file_size = os.fstat(stream.fileno()).st_size
    if not 0 < size <= min(file_size - 8, MAX_HEADER_BYTES):
        raise ValueError("not a safetensors file")
    header = json.loads(stream.read(size))
    data, end = 8 + size, 8 + size
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        first, last = entry["data_offsets"]
        if first != end - data or last < first:
            raise ValueError(f"tensor {name!r} is not where the next one should be")
        entry["data_offsets"] = [data + first, data + last]
        end = data + last
    if end != file_size:
        raise ValueError(f"its tensors end at byte {end}, the file at {file_size}")
    return header


def _skeleton(path: str | Path, dtype: torch.dtype, manifest: dict[str, Any], header: dict[str, Any]) -> CausalLM:
    """The model on the meta device, shaped as the manifest says: experts unstacked, quantized
    projections holding meta buffers of the file's shapes and dtypes (checked against the layer's)."""
    config = load_model_config(path)
    with torch.device("meta"):
        model = model_class(config.architecture)(config).to(dtype)
    for name in manifest["unstacked"]:
        stack = model.get_submodule(name)
        if not isinstance(stack, Experts):
            raise ValueError(f"{name!r} is not an expert stack")
        stack.unstack_()
    for name, (bits, group, symmetric) in manifest["quantized"].items():
        if name == "lm_head" and model.lm_head is None:  # a tied head quantized on its own
            model.lm_head = untied_head(model)
        layer = model.get_submodule(name)
        if not isinstance(layer, Linear):
            raise ValueError(f"{name!r} is not a projection")
        del layer.weight
        for buffer in QUANTIZED_BUFFERS:
            stored = header.get(f"{name}.{buffer}")
            kind = None if stored is None else _TORCH_DTYPES[stored["dtype"]]
            value = None if stored is None else torch.empty(stored["shape"], dtype=kind, device="meta")
            layer.register_buffer(buffer, value)
        layer.quantization = QuantScheme(bits, group, symmetric)
        weight = layer.quantized_weight()
        fits = weight.shape == (layer.out_features, layer.in_features) and weight.bits == bits
        if not fits or weight.qweight.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"the quantized weight of {name!r} does not fit the layer")
    return model


def _fill(model: CausalLM, stream: BinaryIO, header: dict[str, Any], manifest: dict[str, Any]) -> CausalLM:
    """Materialize ``model`` with its tensors viewing a private memory map of the file (a tensor that
    does not start on a cache line is copied out), its pages read in now."""
    mapping = mmap.mmap(stream.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        mapping.madvise(MADV_POPULATE_READ)  # page tables filled from the page cache, the file read if cold
    except OSError:  # before Linux 5.14
        mapping.madvise(mmap.MADV_WILLNEED)
    model.to_empty(device="cpu")
    for name, tensor in _tensors(model).items():
        first = header[name]["data_offsets"][0]
        view = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel(), offset=first).view(tensor.shape)
        tensor.data = view if first % ALIGN_BYTES == 0 else view.clone()
    model.build_rotary(torch.device("cpu"))
    model.quantization = None if manifest["quantization"] is None else QuantScheme(*manifest["quantization"])
    model.checkpoint_quantization = manifest["checkpoint_quantization"]
    return model.eval()
