"""A GGUF file as a checkpoint folder: its metadata converted once into the files tokenmill reads.

:func:`checkpoint_folder` maps a model path to the folder the rest of tokenmill reads: a Hugging
Face checkpoint folder as it is; a ``.gguf`` file (or a folder holding exactly one and no
safetensors) to its converted folder under the cache (``$TOKENMILL_CACHE_DIR``, default
``~/.cache/tokenmill``, then ``gguf/<file stem>-<key>``, the key a hash of the file's absolute path,
size, modification time and :data:`CONVERTER_VERSION`). The converted folder holds:

- ``config.json``: the config ``transformers`` runs the file with: its config class built from what
  it reads in the metadata, so what the file does not say is that class's default, as in
  transformers (Qwen3's ``head_dim`` 128, Gemma's ``query_pre_attn_scalar`` 256), with
  ``architectures`` set and ``tie_word_embeddings`` false: a file without ``output.weight`` (tied
  embeddings) gets its LM head loaded from ``token_embd.weight``, so a quantized embedding table
  stays a quantized LM head. A "llama" file with experts (how llama.cpp writes Mixtral) is run as
  ``MixtralForCausalLM``: the Llama config transformers reads (without the experts) made a Mixtral
  one with the file's expert counts and no window, as llama.cpp runs it (softmax routing over all
  experts, the top ``expert_used_count`` renormalized). One value transformers does not read is the
  file's: a Qwen3-MoE file's expert width (``qwen3moe.expert_feed_forward_length``, where
  transformers keeps the class's 768 and then fails on the tensors of any other width), and its
  ``rope_freqs.weight`` tensor
  (llama.cpp's frequency divisors, how it stores Llama 3.1's RoPE scaling; transformers ignores it)
  as ``rope_scaling["freq_factors"]``;
- the tokenizer (``transformers``' GGUF converter: BPE or SentencePiece, special tokens, chat template);
- :data:`INDEX_FILE`: the GGUF file's path, its architecture, whether its output is tied to the
  embeddings, and each tensor's name, ggml type,
  torch-order shape and byte range (``model/gguf_loader.py`` memory-maps the file and reads each once).

The folder is written beside its final name and renamed into place, so concurrent conversions and
readers never see half a folder. Bad input is a :class:`GGUFError` naming the file and what is
wrong (not a GGUF file, truncated, an unsupported architecture or tensor type), raised before any
model or KV memory exists. Mixtures of experts load from "qwen3moe" files and from "llama" files with
experts (Mixtral), whose stacked expert tensors (``ffn_gate_exps``...) transformers does not read:
tests check those against transformers' Mixtral on the file's weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONVERTER_VERSION = 4
"""Bump when the converted folder's contents change: old conversions are then redone."""

INDEX_FILE = "gguf_tensors.json"
ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's per-frequency RoPE divisors (how it stores Llama 3.1's scaling): read into the config."""

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
"""GGUF ``general.architecture`` -> the model class tokenmill runs it with."""
MOE_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM", "llama": "MixtralForCausalLM"}
"""The architectures whose files may hold experts (``{arch}.expert_count``) -> the model class a file
with experts runs with."""


class GGUFError(ValueError):
    """A GGUF file tokenmill cannot run; the message names the file and what is wrong."""


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names (the file itself, or the one ``.gguf`` of a folder without
    safetensors), or None for anything else. Raises GGUFError for a folder of several ``.gguf``."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or any(path.glob("*.safetensors*")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} .gguf files ({', '.join(f.name for f in found)}): name one")
    return found[0] if found else None


def checkpoint_folder(path: str | Path) -> Path:
    """The checkpoint folder tokenmill reads for the model ``path``: the GGUF file's converted folder
    (converted now if it is not in the cache yet), else ``path`` itself."""
    file = gguf_file(path)
    if file is None:
        return Path(path)
    folder = cache_root() / "gguf" / f"{file.stem}-{_key(file)}"
    if not is_converted(folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            convert(file, staging)
            try:
                os.rename(staging, folder)
            except OSError:  # another process converted it first
                if not is_converted(folder):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def is_converted(folder: str | Path) -> bool:
    """Whether ``folder`` is a converted GGUF folder (without reading its index)."""
    return (Path(folder) / INDEX_FILE).is_file()


def read_index(folder: str | Path) -> dict | None:
    """The tensor index of a converted folder (None: ``folder`` is not one)."""
    return json.loads((Path(folder) / INDEX_FILE).read_text()) if is_converted(folder) else None


def convert(file: Path, folder: Path) -> None:
    """Write ``file``'s config, tokenizer and tensor index into ``folder`` (which exists)."""
    from gguf import GGML_QUANT_SIZES
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    size = file.stat().st_size
    try:
        reader = _reader(file)
    except _Truncated as exc:
        raise GGUFError(
            f"{file} is truncated: it is {size} bytes long, its contents need at least {exc.args[0]}"
        ) from None
    except Exception as exc:  # the gguf package raises ValueError, struct.error, IndexError... on bad bytes
        raise GGUFError(f"{file} is not a readable GGUF file: {exc}") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    experts = _field(reader, f"{arch}.expert_count")
    if experts and arch not in MOE_ARCHITECTURES:
        raise GGUFError(
            f"{file}: architecture {arch!r} with {experts} experts is not supported; mixtures of experts are "
            f"supported in files of architecture {' or '.join(map(repr, MOE_ARCHITECTURES))}"
        )
    tensors, freq_factors = [], None
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            freq_factors = [float(x) for x in tensor.data.astype("float64").ravel()]
            continue
        if tensor.tensor_type not in GGML_QUANT_SIZES:
            raise GGUFError(f"{file}: tensor {tensor.name!r} has an unknown type {tensor.tensor_type!r}")
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        tensors.append(
            {
                "name": tensor.name,
                "type": int(tensor.tensor_type),
                "shape": shape,
                "offset": int(tensor.data_offset),
                "bytes": int(tensor.n_bytes),
            }
        )
    try:
        with _parsed_once(file, reader):
            config = AutoConfig.for_model(**load_gguf_checkpoint(str(file), return_tensors=False)["config"]).to_dict()
            tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as exc:  # transformers' converter: KeyError, ValueError... on metadata it cannot map
        raise GGUFError(f"{file}: cannot convert its metadata: {exc!r}") from None
    tied = not any(t["name"] == "output.weight" for t in tensors)
    if experts and config.get("model_type") == "llama":
        used = int(_field(reader, f"{arch}.expert_used_count") or 0)
        if not 0 < used <= experts:
            raise GGUFError(f"{file}: {arch}.expert_used_count {used} is not between 1 and expert_count {experts}")
        config = _mixtral_config(config, int(experts), used)
    config.update(
        architectures=[MOE_ARCHITECTURES[arch] if experts else ARCHITECTURES[arch]], tie_word_embeddings=False
    )
    expert_width = _field(reader, f"{arch}.expert_feed_forward_length")
    if arch == "qwen3moe" and expert_width:
        config["moe_intermediate_size"] = int(expert_width)
    config.pop("_model_name_or_path", None)
    if freq_factors is not None:  # llama.cpp's frequency factors (Llama 3.1's scaling), which transformers ignores
        rope_scaling = config.get("rope_scaling") or {"rope_type": "default"}
        config["rope_scaling"] = {**rope_scaling, "freq_factors": freq_factors}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(str(folder))
    index = {"file": str(file.resolve()), "architecture": arch, "tied_output": tied, "tensors": tensors}
    (folder / INDEX_FILE).write_text(json.dumps(index))


def _mixtral_config(llama: dict[str, Any], experts: int, used: int) -> dict[str, Any]:
    """The Mixtral config of a "llama" file with ``experts`` experts, ``used`` of them per token, from
    the Llama config transformers reads from it (its ``intermediate_size``, the file's
    ``feed_forward_length``, is each expert's width, as llama.cpp's converter writes it); no window."""
    from transformers import AutoConfig

    dropped = ("model_type", "architectures", "transformers_version", "mlp_bias", "attention_bias", "pretraining_tp")
    kept = {key: value for key, value in llama.items() if key not in dropped}
    mixtral = AutoConfig.for_model("mixtral", **kept, num_local_experts=experts, num_experts_per_tok=used)
    mixtral.sliding_window = None
    return mixtral.to_dict()


class _Truncated(Exception):
    """A read past the end of the file; its argument: the byte the read needed the file to reach."""


def _reader(file: Path) -> Any:  # a gguf.GGUFReader (gguf is imported on first use)
    """``gguf.GGUFReader`` of ``file``, raising :class:`_Truncated` on a read past the end of the file
    (gguf's own reader takes the short slice, then fails wherever it uses it, on array shapes). It
    slices a plain array over the file's memory map (numpy's memmap runs Python code for every slice,
    and parsing a tokenizer's metadata takes hundreds of thousands), with its own bounds-checked
    read."""
    import numpy as np
    from gguf import GGUFReader

    itemsizes: dict[Any, int] = {}

    class Reader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._array

        @data.setter
        def data(self, mapped: Any) -> None:
            self._array = mapped.view(np.ndarray)  # the same bytes; the view keeps the mapping alive

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> Any:
            """``count`` values of ``dtype`` from byte ``offset``, in the file's byte order (or
            ``override_order``); the read past the file's end raises."""
            count = int(count)
            itemsize = itemsizes.get(dtype) or itemsizes.setdefault(dtype, np.dtype(dtype).itemsize)
            end = offset + itemsize * count
            if end > self._array.size:
                raise _Truncated(end)
            values = self._array[offset:end].view(dtype)
            return values.view(values.dtype.newbyteorder(override_order or self.byte_order))

    return Reader(file)


_PARSED_ONCE_LOCK = threading.Lock()


@contextlib.contextmanager
def _parsed_once(file: Path, reader: Any) -> Iterator[None]:
    """While in the block, ``gguf.GGUFReader(file)`` (as transformers' GGUF config and tokenizer
    loaders call it) gives ``reader``, the file parsed once, instead of parsing it again; other
    paths are parsed as usual. One block at a time in the process (conversions in two threads take
    turns), so gguf's own class is always what it gets back."""
    import gguf

    with _PARSED_ONCE_LOCK:
        parse = gguf.GGUFReader
        target = file.resolve()

        def reader_of(path: Any, *args: Any, **kwargs: Any) -> Any:
            return reader if Path(path).resolve() == target else parse(path, *args, **kwargs)

        gguf.GGUFReader = reader_of
        try:
            yield
        finally:
            gguf.GGUFReader = parse


def _field(reader, key: str):  # noqa: ANN001, ANN202 (gguf's reader types)
    """A scalar or string metadata value (None when absent)."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _key(file: Path) -> str:
    stat = file.stat()
    text = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tokenmill"
