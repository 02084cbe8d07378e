"""The Triton LoRA kernels (``tokenmill/kernels/lora_triton.py``) against the float64 oracle of
``test_lora_kernel.py``, run on CPU tensors by Triton's interpreter (``tests/kernels/conftest.py``):
fp32 and fp16 (the interpreter's ``tl.dot`` is wrong on bf16), every row/slot pattern and segment
layout the C++ kernel is tested on, tiles of one slot across several row blocks, a rank wider than
one rank block, ``LoRABatch.tiles`` against its definition, and an engine on Triton attention and
these kernels against PEFT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_lora import ALL_PROJECTIONS, PROMPTS, hf_greedy, ours, prompt_logprobs, save_adapter
from tests.kernels.test_lora_kernel import (
    FP32_MAG_TOL,
    ROW_SLOTS,
    WIDTHS,
    assert_within,
    oracle,
    run_case,
    segments_of,
)
from tests.tiny_models import make_hf_model, save_tiny_checkpoint
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.kernels import linear as linear_module
from tokenmill.kernels.lora import TILE_ROWS, LoRABatch, LoRABinding, LoRAWeights

pytest.importorskip("triton", reason="needs triton")

FP16_REL = 2.0**-11  # the output rounded once to fp16 (half an ulp)
FP16_MAG_TOL = 2.0**-11 + 1e-5  # the shrink rounded to fp16 before the expand (as the torch reference), fp32 sums


@pytest.fixture(scope="module")
def add_lora_triton() -> Any:
    from tokenmill.kernels import lora_triton

    kernel = lora_triton._shrink_kernel
    assert type(kernel).__name__ == "InterpretedFunction", "TRITON_INTERPRET=1 must be set before the first import"
    return lora_triton.add_lora_triton


@pytest.mark.parametrize("slots_name", list(ROW_SLOTS))
@pytest.mark.parametrize("widths_name", list(WIDTHS))
@pytest.mark.parametrize("in_features", [5, 130])  # below one 64-wide K block; two blocks and a tail
def test_triton_fp32_matches_oracle(add_lora_triton: Any, in_features: int, widths_name: str, slots_name: str) -> None:
    widths, row_slots = WIDTHS[widths_name], ROW_SLOTS[slots_name]
    got, want, mag = run_case(add_lora_triton, in_features, widths, torch.float32, row_slots, 1)
    assert_within(got, want, mag, rel=0.0, mag_tol=FP32_MAG_TOL)


@pytest.mark.parametrize("slots_name", ["mixed", "two-slots-and-none"])
@pytest.mark.parametrize("widths_name", ["one-segment", "wide"])
def test_triton_fp16_matches_oracle(add_lora_triton: Any, widths_name: str, slots_name: str) -> None:
    got, want, mag = run_case(add_lora_triton, 37, WIDTHS[widths_name], torch.float16, ROW_SLOTS[slots_name], 2)
    assert got.dtype == torch.float16
    assert_within(got, want, mag, rel=FP16_REL, mag_tol=FP16_MAG_TOL)


def test_triton_many_rows_per_slot_and_a_wide_rank(add_lora_triton: Any) -> None:
    """Slots with more rows than one tile (40 = 16 + 16 + 8, 17 = 16 + 1) and rank 80 (two rank
    blocks of the expand, three of the shrink's 240 ranks)."""
    gen = torch.Generator().manual_seed(5)
    in_features, widths, rank = 70, (48, 16, 16), 80
    weights = LoRAWeights(LoRABinding(), 3, rank, in_features, segments_of(widths), torch.float32, torch.device("cpu"))
    for slot, r in enumerate((80, 33, 1)):
        for j, cols in enumerate(weights.segments):
            lora_a = torch.randn(r, in_features, generator=gen)
            lora_b = torch.randn(cols.stop - cols.start, r, generator=gen)
            weights.load(slot, j, lora_a, lora_b, scaling=0.25)
    row_slots = [0] * 40 + [-1] * 3 + [2] * 17 + [1, -1, 0]
    perm = torch.randperm(len(row_slots), generator=gen)
    row_slots = [row_slots[i] for i in perm.tolist()]
    x = torch.randn(len(row_slots), in_features, generator=gen)
    out = torch.randn(len(row_slots), weights.b.shape[2], generator=gen)
    want, mag = oracle(out, x, weights, row_slots)
    batch = LoRABatch.from_row_slots(torch.tensor(row_slots))
    assert batch is not None
    got = out.clone()
    add_lora_triton(got, x, weights, batch)
    assert_within(got, want, mag, rel=0.0, mag_tol=FP32_MAG_TOL)
    unused = [t for t, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[unused], out[unused])


def test_tiles_cover_each_slots_rows_in_blocks() -> None:
    row_slots = [1] * 20 + [-1, 0] + [3] * 16 + [1]
    batch = LoRABatch.from_row_slots(torch.tensor(row_slots))
    assert batch is not None
    tiles = batch.tiles.tolist()
    assert batch.tiles.dtype == torch.int32
    covered: list[int] = []
    for slot, start, end in tiles:
        assert 0 < end - start <= TILE_ROWS
        rows = batch.order[start:end].tolist()
        assert all(row_slots[r] == slot for r in rows)
        covered += list(range(start, end))
    assert covered == list(range(batch.order.numel()))  # every sorted position once, in order
    assert [t[0] for t in tiles] == [0, 1, 1, 3]  # 1 row of slot 0; 21 of slot 1 (16 + 5); 16 of slot 3


def test_engine_with_triton_attention_and_triton_lora_equals_peft(
    add_lora_triton: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path as far as a CPU runs it: Triton attention and the Triton LoRA kernels (routed to
    for CPU tensors here; a CUDA batch takes them in ``add_lora``), a mixed batch of the base model
    and two adapters equal to PEFT's merged models (fp32 prompt logprobs 1e-4, greedy tokens)."""
    oracles: dict[str | None, torch.nn.Module] = {None: save_tiny_checkpoint(tmp_path / "base", "llama")}
    oracles["a"] = save_adapter(make_hf_model("llama"), tmp_path / "a", 1, ALL_PROJECTIONS, rank=8)
    oracles["c"] = save_adapter(make_hf_model("llama"), tmp_path / "c", 3, ["o_proj", "down_proj"], rank=2)
    used: list[int] = []

    def triton_lora(*args: Any) -> None:
        used.append(1)
        add_lora_triton(*args)

    monkeypatch.setattr(linear_module, "add_lora", triton_lora)
    llm = LLM(
        model=str(tmp_path / "base"),
        dtype="float32",
        attention_backend="triton",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules={name: str(tmp_path / name) for name in "ac"},
    )
    try:
        names = [None, "a", "c", "a"]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
        requests = [None if n is None else LoRARequest(n) for n in names]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        for name, prompt, output in zip(names, prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == hf_greedy(oracles[name], prompt, 4), name
            torch.testing.assert_close(ours(output), prompt_logprobs(oracles[name], prompt), atol=1e-4, rtol=0)
    finally:
        llm.shutdown()
    assert used, "the Triton LoRA kernels never ran"
