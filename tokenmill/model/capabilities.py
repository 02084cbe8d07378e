"""The capability table's checks: which backend runs which model, where, in which dtypes.

Every backend declares a :class:`~tokenmill.attention.capabilities.BackendCapabilities` (listed by
name in ``attention/factory.py``'s ``BACKENDS``) and every family a :class:`FamilyCapabilities`
(``CausalLM.capabilities``). When an engine is built, ``CausalLM.make_backend`` describes what it
would run as a :class:`Combination` and :func:`choose_backend` checks it here, in one place: an
explicit backend that cannot run it, or a family that cannot, raises one ValueError naming every
unsupported part; "auto" takes the first backend in the table's order that supports it and is
available. The path choices that follow from the same table (the C++ decode forward) are here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.capabilities import BackendCapabilities
from tokenmill.attention.factory import BACKENDS


@dataclass(frozen=True)
class FamilyCapabilities:
    """One family's row of the capability table."""

    tensor_parallel: bool = False
    """Its layers are built from the tensor-parallel-aware blocks only (``parallel.py``)."""
    cpu_decode_forward: bool = False
    """An explicit opt-in: its layer computes exactly what ``kernels/cpu/decode_forward.cpp`` computes
    (``CausalLM.cpu_decode_weights`` still checks each instance's parameters)."""
    partial_rotary: bool = False
    """Its layers follow ``partial_rotary_factor`` < 1 as its transformers implementation does."""


@dataclass(frozen=True)
class Combination:
    """What an engine would run: a model of ``architecture`` (its family's capabilities, whether
    any layer slides, whether it soft-caps attention logits) over ``tensor_parallel_size`` ranks on
    ``device``, in ``dtype`` with a ``kv_dtype`` KV cache."""

    architecture: str
    family: FamilyCapabilities
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    tensor_parallel_size: int = 1
    sliding_window: bool = False
    softcap: bool = False


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def backend_refusals(caps: BackendCapabilities, combo: Combination, explicit: bool) -> list[str]:
    """What of ``combo`` a backend of ``caps`` does not support (empty: it runs it); ``explicit``:
    the user named the backend (its interpreter devices count)."""
    reasons = []
    if not caps.runs_on(combo.device, explicit):
        reasons.append(f"device {combo.device.type} (it runs on {'/'.join(caps.devices or ())})")
    if combo.dtype not in caps.dtypes:
        reasons.append(f"a {_names((combo.dtype,))} model (it runs {_names(caps.dtypes)})")
    elif not caps.reads_kv(combo.dtype, combo.kv_dtype):
        needs = _names(caps.dtypes) if caps.converts_kv_dtype else "the model's dtype (kv_cache_dtype 'auto')"
        reasons.append(f"a {_names((combo.kv_dtype,))} KV cache (it needs {needs})")
    if combo.sliding_window and not caps.sliding_window:
        reasons.append("sliding-window attention, which this model uses")
    if combo.softcap and not caps.softcap:
        reasons.append("attention logit soft-capping, which this model uses")
    return reasons


def check_tensor_parallel(architecture: str, family: FamilyCapabilities, size: int) -> None:
    """Raise ValueError when the family cannot be split over ``size`` ranks."""
    if size > 1 and not family.tensor_parallel:
        raise ValueError(f"{architecture} does not support tensor_parallel_size > 1")


def choose_backend(requested: str, combo: Combination) -> str:
    """The backend that runs ``combo``: ``requested`` itself after checking it (strict: no fallback),
    or for "auto" the first supporting and available one of ``BACKENDS``. Raises ValueError naming
    the unsupported combination."""
    check_tensor_parallel(combo.architecture, combo.family, combo.tensor_parallel_size)
    if requested != "auto":
        reasons = backend_refusals(BACKENDS[requested].capabilities, combo, explicit=True)
        if reasons:
            raise ValueError(
                f"attention_backend={requested!r} cannot run {combo.architecture} here; it does not support "
                + "; ".join(reasons)
            )
        return requested
    for name, entry in BACKENDS.items():
        if not backend_refusals(entry.capabilities, combo, explicit=False) and entry.available():
            return name
    raise ValueError(f"no attention backend runs {combo}")


def cpu_decode_forward_applies(
    backend: BackendCapabilities, family: FamilyCapabilities, softcap: bool, tensor_parallel_size: int
) -> bool:
    """Whether the C++ decode forward computes this model's decode step with this backend: both
    opted in, no attention soft-capping (the kernel has none), one rank."""
    return backend.cpu_decode_forward and family.cpu_decode_forward and not softcap and tensor_parallel_size == 1
