"""The LoRA products of ``tokenmill/kernels/lora.py`` against an independent per-row oracle.

The C++ ``torch.ops.tokenmill_cpu.lora_add`` (reached through ``add_lora``) and the torch
``add_lora_reference`` are both checked against :func:`oracle`, written here from the layout's
definition: for each row ``t`` with slot ``s >= 0``, ``delta_t`` is the concatenation over segments
``j`` of ``(x_t @ a[s, j*R:(j+1)*R].T) @ b[s, :, cols_j]``, computed in float64 from the operands'
values and added to ``out[t]``; rows with slot -1 are unchanged. Also: ``LoRAWeights.load`` /
``clear`` against the layout they promise, ``LoRABatch.from_row_slots`` against a Python sort, and
the C++ op's index checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tokenmill.kernels import lora as lora_module
from tokenmill.kernels.cpu import load_cpu_kernels
from tokenmill.kernels.lora import CPP_MAX_ROWS, LoRABatch, LoRABinding, LoRAWeights, add_lora, add_lora_reference

needs_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="needs the C++ CPU kernels (a C++ compiler and ninja)"
)

MAX_LORAS = 4
MAX_RANK = 8
RANKS = (8, 3, 5, 1)  # each slot's adapter rank (slot 0 uses every rank, the others leave padding)

# Tolerances, elementwise: |got - want| <= rel * |want| + mag_tol * mag, where ``mag`` is the sum of
# the absolute values of every term of the element (|out| + sum over r of |y_r| * |b_rc|, with
# |y_r| = sum of |x| * |a|), so cancellation cannot hide or fake an error.
FP32_MAG_TOL = 1e-5  # fp32 operands, fp32 sums
BF16_REL = 2.0**-8  # the C++ kernel sums in fp32 and rounds each output once to bf16 (half an ulp)
BF16_MAG_TOL = 1e-5  # plus its fp32 sums
BF16_REFERENCE_MAG_TOL = 3 * 2.0**-8  # the torch reference rounds the shrink, the expand and the add to bf16


def segments_of(widths: Sequence[int]) -> list[slice]:
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def make_weights(in_features: int, widths: Sequence[int], dtype: torch.dtype, seed: int = 0) -> LoRAWeights:
    """Every slot holds a random adapter of rank ``RANKS[slot]`` for every segment, loaded with ``load``."""
    gen = torch.Generator().manual_seed(seed)
    segments = segments_of(widths)
    weights = LoRAWeights(LoRABinding(), MAX_LORAS, MAX_RANK, in_features, segments, dtype, torch.device("cpu"))
    for slot, rank in enumerate(RANKS):
        for j, cols in enumerate(segments):
            lora_a = torch.randn(rank, in_features, generator=gen)
            lora_b = torch.randn(cols.stop - cols.start, rank, generator=gen)
            weights.load(slot, j, lora_a.to(dtype), lora_b.to(dtype), scaling=0.5)
    return weights


def oracle(
    out: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, row_slots: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(want, mag)`` in float64: ``out`` plus each row's delta, and each element's sum of absolute terms."""
    rank = weights.rank
    a, b = weights.a.double(), weights.b.double()
    want, mag = out.double().clone(), out.double().abs()
    for t, s in enumerate(row_slots):
        if s < 0:
            continue
        xt = x[t].double()
        parts, abs_parts = [], []
        for j, cols in enumerate(weights.segments):
            a_j = a[s, j * rank : (j + 1) * rank]  # [R, in]
            y = a_j @ xt  # [R]
            y_abs = a_j.abs() @ xt.abs()
            parts.append(y @ b[s, :, cols])
            abs_parts.append(y_abs @ b[s, :, cols].abs())
        want[t] += torch.cat(parts)
        mag[t] += torch.cat(abs_parts)
    return want, mag


def assert_within(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, rel: float, mag_tol: float) -> None:
    err = (got.double() - want).abs()
    bound = rel * want.abs() + mag_tol * mag
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"element {divmod(worst, got.shape[1])}: got {got.flatten()[worst].item()}, want {want.flatten()[worst].item()}"
    )


class KernelRecorder:
    """Stands in for ``load_cpu_kernels()``'s result in ``lora.py`` and records which ops ran."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels
        self.used: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.used.append(name)
        return getattr(self.kernels, name)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> KernelRecorder:
    kernels = load_cpu_kernels()
    assert kernels is not None
    rec = KernelRecorder(kernels)
    monkeypatch.setattr(lora_module, "load_cpu_kernels", lambda: rec)
    return rec


ROW_SLOTS = {
    "mixed": [2, -1, 0, 2, -1, 1, 0, -1, 3, 2, 1, -1],  # every slot, out of order, -1 rows interleaved
    "one-slot": [1, 1, 1, 1, 1],  # every row uses one slot (the reference's whole-batch branch)
    "one-row": [3],
    "two-slots-and-none": [-1, 0, -1, 0, 2, -1],
}
WIDTHS = {
    "one-segment": (70,),  # 70: one full 64-column block and a partial one
    "qkv": (24, 8, 8),
    "qkv-across-blocks": (54, 8, 8),  # k ends and v starts around the 64-column block boundary
    "wide": (100, 20, 20),  # three column blocks, v split between two of them
}


def run_case(
    fn: Any, in_features: int, widths: Sequence[int], dtype: torch.dtype, row_slots: Sequence[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn(out, x, weights, batch)`` on random operands; returns ``(got, want, mag)``."""
    weights = make_weights(in_features, widths, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(row_slots), in_features, generator=gen).to(dtype)
    out = torch.randn(len(row_slots), weights.b.shape[2], generator=gen).to(dtype)
    want, mag = oracle(out, x, weights, row_slots)
    batch = LoRABatch.from_row_slots(torch.tensor(row_slots, dtype=torch.int64))
    assert batch is not None
    got = out.clone()
    fn(got, x, weights, batch)
    for t, s in enumerate(row_slots):
        if s < 0:
            assert torch.equal(got[t], out[t]), f"row {t} has no slot and must be unchanged"
    return got, want, mag


# ------------------------------------------------------------------------------ the C++ kernel


@needs_kernels
@pytest.mark.parametrize("slots_name", list(ROW_SLOTS))
@pytest.mark.parametrize("widths_name", list(WIDTHS))
@pytest.mark.parametrize("in_features", [5, 37, 45])  # below one vector; 16-wide + tail; 16 + 8 + tail
def test_cpp_kernel_fp32_matches_oracle(
    recorder: KernelRecorder, in_features: int, widths_name: str, slots_name: str
) -> None:
    got, want, mag = run_case(add_lora, in_features, WIDTHS[widths_name], torch.float32, ROW_SLOTS[slots_name], 1)
    assert recorder.used == ["lora_add"]
    assert_within(got, want, mag, rel=0.0, mag_tol=FP32_MAG_TOL)


@needs_kernels
@pytest.mark.parametrize("slots_name", list(ROW_SLOTS))
@pytest.mark.parametrize("widths_name", list(WIDTHS))
@pytest.mark.parametrize("in_features", [37, 64])
def test_cpp_kernel_bf16_matches_oracle(
    recorder: KernelRecorder, in_features: int, widths_name: str, slots_name: str
) -> None:
    got, want, mag = run_case(add_lora, in_features, WIDTHS[widths_name], torch.bfloat16, ROW_SLOTS[slots_name], 2)
    assert got.dtype == torch.bfloat16 and recorder.used == ["lora_add"]
    assert_within(got, want, mag, rel=BF16_REL, mag_tol=BF16_MAG_TOL)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_kernel_zero_slot_changes_nothing(recorder: KernelRecorder, dtype: torch.dtype) -> None:
    weights = make_weights(37, (24, 8, 8), dtype)
    weights.clear(2)
    assert not weights.a[2].any() and not weights.b[2].any()
    assert weights.a[1].any() and weights.b[1].any()  # the other slots keep their adapters
    x = torch.randn(4, 37).to(dtype)
    out = torch.randn(4, 40).to(dtype)
    got = out.clone()
    batch = LoRABatch.from_row_slots(torch.tensor([2, 2, -1, 2]))
    assert batch is not None
    add_lora(got, x, weights, batch)
    assert recorder.used == ["lora_add"]
    assert torch.equal(got, out)
    # The same rows on a slot that holds an adapter do change (the check above can fail).
    batch = LoRABatch.from_row_slots(torch.tensor([1, 1, -1, 1]))
    assert batch is not None
    add_lora(got, x, weights, batch)
    assert not torch.equal(got[0], out[0]) and torch.equal(got[2], out[2])


@needs_kernels
def test_add_lora_beyond_cpp_max_rows_uses_torch(recorder: KernelRecorder) -> None:
    row_slots = [(t % 5) - 1 for t in range(CPP_MAX_ROWS + 1)]
    got, want, mag = run_case(add_lora, 37, (24, 8, 8), torch.float32, row_slots, 3)
    assert recorder.used == []
    assert_within(got, want, mag, rel=0.0, mag_tol=FP32_MAG_TOL)


def _direct_args(n_rows: int = 3) -> tuple[torch.Tensor, torch.Tensor, LoRAWeights]:
    weights = make_weights(37, (24, 8, 8), torch.float32)
    return torch.randn(n_rows, 40), torch.randn(n_rows, 37), weights


@needs_kernels
@pytest.mark.parametrize("bad_slot", [MAX_LORAS, MAX_LORAS + 7, -1])
def test_cpp_kernel_rejects_slot_out_of_range(bad_slot: int) -> None:
    out, x, weights = _direct_args()
    before = out.clone()
    order, bounds = torch.tensor([0, 2, 1]), torch.tensor([0, 2, 3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.tokenmill_cpu.lora_add(
            out, x, weights.a, weights.b, order, bounds, torch.tensor([0, bad_slot]), weights.column_bounds
        )
    assert torch.equal(out, before)
    # The same call with slots in range is accepted.
    torch.ops.tokenmill_cpu.lora_add(
        out, x, weights.a, weights.b, order, bounds, torch.tensor([0, 3]), weights.column_bounds
    )
    assert not torch.equal(out, before)


@needs_kernels
@pytest.mark.parametrize("bad_row", [3, 100, -1])
def test_cpp_kernel_rejects_row_out_of_range(bad_row: int) -> None:
    out, x, weights = _direct_args()
    before = out.clone()
    bounds, slots = torch.tensor([0, 2, 3]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="row out of range"):
        torch.ops.tokenmill_cpu.lora_add(
            out, x, weights.a, weights.b, torch.tensor([0, bad_row, 1]), bounds, slots, weights.column_bounds
        )
    assert torch.equal(out, before)


@needs_kernels
@pytest.mark.parametrize(
    ("order", "bounds", "slots", "message"),
    [
        ([0, 1, 2], [0, 5, 3], [0, 1], "bounds must not decrease"),  # once a crash: rows past the batch
        ([0, 1, 2], [1, 3], [0], "bounds must cover order"),  # once accepted: row 0 skipped
        ([0, 1, 1], [0, 2, 3], [0, 1], "one slot only"),  # two threads would write row 1
    ],
)
def test_cpp_kernel_rejects_malformed_groups(
    order: list[int], bounds: list[int], slots: list[int], message: str
) -> None:
    out, x, weights = _direct_args()
    before = out.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tokenmill_cpu.lora_add(
            out,
            x,
            weights.a,
            weights.b,
            torch.tensor(order),
            torch.tensor(bounds),
            torch.tensor(slots),
            weights.column_bounds,
        )
    assert torch.equal(out, before)


# ------------------------------------------------------------------------------ the torch reference


@pytest.mark.parametrize("slots_name", list(ROW_SLOTS))
@pytest.mark.parametrize("widths_name", list(WIDTHS))
def test_reference_fp32_matches_oracle(widths_name: str, slots_name: str) -> None:
    got, want, mag = run_case(add_lora_reference, 37, WIDTHS[widths_name], torch.float32, ROW_SLOTS[slots_name], 4)
    assert_within(got, want, mag, rel=0.0, mag_tol=FP32_MAG_TOL)


@pytest.mark.parametrize("slots_name", list(ROW_SLOTS))
@pytest.mark.parametrize("widths_name", ["one-segment", "qkv-across-blocks"])
def test_reference_bf16_matches_oracle(widths_name: str, slots_name: str) -> None:
    got, want, mag = run_case(add_lora_reference, 37, WIDTHS[widths_name], torch.bfloat16, ROW_SLOTS[slots_name], 5)
    assert got.dtype == torch.bfloat16
    assert_within(got, want, mag, rel=0.0, mag_tol=BF16_REFERENCE_MAG_TOL)


def test_reference_zero_slot_changes_nothing() -> None:
    weights = make_weights(37, (70,), torch.float32)
    weights.clear(0)
    out = torch.randn(3, 70)
    got = out.clone()
    batch = LoRABatch.from_row_slots(torch.tensor([0, 0, 0]))
    assert batch is not None
    add_lora_reference(got, torch.randn(3, 37), weights, batch)
    assert torch.equal(got, out)


# ------------------------------------------------------------------------------ LoRAWeights and LoRABatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_pads_ranks_and_folds_scaling(dtype: torch.dtype) -> None:
    segments = segments_of((24, 8, 8))
    weights = LoRAWeights(LoRABinding(), 3, MAX_RANK, 37, segments, dtype, torch.device("cpu"))
    rank, scaling = 3, 0.25
    lora_a, lora_b = torch.randn(rank, 37).to(dtype), torch.randn(8, rank).to(dtype)  # segment 1 (k): 8 columns
    weights.load(1, 1, lora_a, lora_b, scaling)

    a, b = weights.a[1], weights.b[1]
    assert torch.equal(a[MAX_RANK : MAX_RANK + rank], lora_a)
    assert not a[MAX_RANK + rank : 2 * MAX_RANK].any(), "ranks past the adapter's stay zero"
    assert not a[:MAX_RANK].any() and not a[2 * MAX_RANK :].any(), "other segments' ranks stay zero"
    assert torch.equal(b[:rank, 24:32], (lora_b.t() * scaling).to(dtype))
    assert not b[rank:].any(), "ranks past the adapter's stay zero"
    assert not b[:, :24].any() and not b[:, 32:].any(), "other segments' columns stay zero"
    assert not weights.a[0].any() and not weights.a[2].any() and not weights.b[0].any() and not weights.b[2].any()
    assert weights.nbytes() == (3 * 3 * MAX_RANK * 37 + 3 * MAX_RANK * 40) * torch.finfo(dtype).bits // 8

    weights.clear(1)
    assert not weights.a.any() and not weights.b.any()


def _group_by_slot(row_slots: list[int]) -> tuple[list[int], list[int], list[int]]:
    """``(order, bounds, slots)`` by a plain Python stable sort."""
    used = sorted((s, t) for t, s in enumerate(row_slots) if s >= 0)  # (slot, row): batch order within a slot
    slots = sorted({s for s, _ in used})
    bounds = [0]
    for s in slots:
        bounds.append(bounds[-1] + sum(1 for u, _ in used if u == s))
    return [t for _, t in used], bounds, slots


@pytest.mark.parametrize("row_slots", [*ROW_SLOTS.values(), [3, -1, 1, 3, 0, -1, 1, 3], [0] * 9, [-1, -1, 2]])
def test_from_row_slots_groups_by_ascending_slot(row_slots: list[int]) -> None:
    batch = LoRABatch.from_row_slots(torch.tensor(row_slots, dtype=torch.int64))
    assert batch is not None
    order, bounds, slots = _group_by_slot(row_slots)
    assert batch.n_rows == len(row_slots)
    assert batch.order.dtype == torch.int64 and batch.order.tolist() == order
    assert batch.bounds == bounds and batch.slots == slots
    for i, s in enumerate(batch.slots):
        assert all(row_slots[t] == s for t in batch.order[batch.bounds[i] : batch.bounds[i + 1]].tolist())


def test_from_row_slots_spelled_out() -> None:
    batch = LoRABatch.from_row_slots(torch.tensor([3, -1, 1, 3, 0, -1, 1, 3]))
    assert batch is not None
    assert (batch.n_rows, batch.order.tolist(), batch.bounds, batch.slots) == (
        8,
        [4, 2, 6, 0, 3, 7],
        [0, 1, 3, 6],
        [0, 1, 3],
    )


@pytest.mark.parametrize("row_slots", [[-1], [-1, -1, -1], []])
def test_from_row_slots_none_without_adapter_rows(row_slots: list[int]) -> None:
    assert LoRABatch.from_row_slots(torch.tensor(row_slots, dtype=torch.int64)) is None
