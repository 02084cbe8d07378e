"""The capability table: one check of a backend x family x device x dtype x KV dtype x tp x model
features combination, "auto" chosen from the same table, and docs/ARCHITECTURE.md's tables equal to
the code's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tokenmill.attention.capabilities import BackendCapabilities
from tokenmill.attention.factory import BACKENDS
from tokenmill.model.capabilities import Combination, FamilyCapabilities, choose_backend
from tokenmill.model.registry import MODELS

ARCHITECTURE_MAP = Path(__file__).parents[2] / "docs" / "ARCHITECTURE.md"
LLAMA = MODELS["LlamaForCausalLM"].capabilities
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def combo(device: torch.device = CPU, dtype: torch.dtype = torch.float32, **kwargs: object) -> Combination:
    kv_dtype = kwargs.pop("kv_dtype", dtype)
    return Combination("LlamaForCausalLM", LLAMA, device, dtype, kv_dtype, **kwargs)


def test_explicit_choices_are_strict() -> None:
    with pytest.raises(ValueError, match="'cpu' cannot run LlamaForCausalLM here; .* a float16 model"):
        choose_backend("cpu", combo(dtype=torch.float16))
    with pytest.raises(ValueError, match="'cpu' cannot run .* device cuda"):
        choose_backend("cpu", combo(CUDA))
    with pytest.raises(ValueError, match="a float16 KV cache"):
        choose_backend("cpu", combo(kv_dtype=torch.float16))
    with pytest.raises(ValueError, match=r"'triton' .* a bfloat16 KV cache \(it needs the model's dtype"):
        choose_backend("triton", combo(CUDA, kv_dtype=torch.bfloat16))
    assert choose_backend("triton", combo()) == "triton"  # CPU: Triton's interpreter, when named


def test_auto_is_the_reference_where_nothing_faster_applies() -> None:
    assert choose_backend("auto", combo(dtype=torch.float16)) == "torch"
    assert choose_backend("auto", combo(dtype=torch.bfloat16, kv_dtype=torch.float16)) == "torch"
    assert choose_backend("auto", combo(torch.device("meta"))) == "torch"
    assert choose_backend("auto", combo()) in ("cpu", "torch")  # cpu where its kernels build


def test_sliding_window_models_get_a_backend_that_applies_the_window() -> None:
    assert choose_backend("auto", combo(sliding_window=True)) in ("cpu", "torch")
    assert choose_backend("auto", combo(dtype=torch.float16, sliding_window=True)) == "torch"
    if BACKENDS["triton"].available():
        assert choose_backend("auto", combo(CUDA, torch.float16, sliding_window=True)) == "triton"
    # soft-capping stays refused by triton: "auto" passes it over on CUDA
    assert choose_backend("auto", combo(CUDA, torch.float16, sliding_window=True, softcap=True)) == "torch"


def test_a_backend_without_windows_is_refused_for_windowed_models(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = BACKENDS["torch"]
    global_only = replace(entry, capabilities=replace(entry.capabilities, sliding_window=False))
    monkeypatch.setitem(BACKENDS, "torch", global_only)
    with pytest.raises(ValueError, match="does not support sliding-window attention, which this model uses"):
        choose_backend("torch", combo(dtype=torch.float16, sliding_window=True))


def test_tensor_parallel_needs_a_family_that_supports_it() -> None:
    assert choose_backend("torch", combo(tensor_parallel_size=2)) == "torch"
    no_tp = replace(combo(tensor_parallel_size=2), family=FamilyCapabilities())
    with pytest.raises(ValueError, match="does not support tensor_parallel_size > 1"):
        choose_backend("torch", no_tp)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _dtypes(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _backend_row(name: str, caps: BackendCapabilities) -> str:
    devices = "any" if caps.devices is None else ", ".join(caps.devices)
    if caps.interpreter_devices:
        devices += f" ({', '.join(caps.interpreter_devices)}: interpreter, tests only)"
    kv = f"any of {_dtypes(caps.dtypes)}" if caps.converts_kv_dtype else "the model's"
    kv += ", int8" if caps.kv_int8 else ""
    kv += ", fp8" if caps.kv_fp8 else ""
    flags = (caps.sliding_window, caps.softcap, caps.cuda_graphs, caps.cpu_decode_forward)
    cells = [f"`{name}`", devices, _dtypes(caps.dtypes), kv, *(_yes(f) for f in flags)]
    return "| " + " | ".join(cells) + " |"


def test_the_maps_capability_tables_match_the_code() -> None:
    text = ARCHITECTURE_MAP.read_text()
    backend_rows = [_backend_row(name, entry.capabilities) for name, entry in BACKENDS.items()]
    family_rows = [
        f"| `{arch}` | {_yes(c.tensor_parallel)} | {_yes(c.cpu_decode_forward)} | {_yes(c.partial_rotary)} |"
        for arch, c in ((arch, cls.capabilities) for arch, cls in MODELS.items())
    ]
    backend_header = (
        "| backend | devices | dtypes | KV cache dtype | sliding window | soft-capping | CUDA graphs "
        "| C++ decode forward |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    family_header = (
        "| architecture | tensor parallel | C++ decode forward | partial rotary |\n| --- | --- | --- | --- |\n"
    )
    assert backend_header + "\n".join(backend_rows) + "\n" in text, "\n".join(backend_rows)
    assert family_header + "\n".join(family_rows) + "\n" in text, "\n".join(family_rows)
