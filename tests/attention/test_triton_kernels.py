"""Triton store / split-KV decode / ragged prefill kernels against the torch-native backend.

Runs on CPU through Triton's interpreter (see conftest.py) at tiny shapes: ragged batches with
cached prefixes, page sizes 1 and 16 (scattered pages), GQA ratios 1/2/4, head_dim 64/128 (and a
non power of two), fp32 and fp16; sliding windows (1 key, a few, wider than the context) in
prefill from scratch, over cached prefixes across the window edge, and split-KV decode.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="needs triton")

from tests.attention.helpers import PagedLayout, make_storage  # noqa: E402
from tokenmill.attention.torch_native import TorchNativeBackend  # noqa: E402
from tokenmill.attention.triton import TritonBackend  # noqa: E402
from tokenmill.attention.triton import backend as triton_backend  # noqa: E402
from tokenmill.attention.triton.config import TritonConfig  # noqa: E402
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view  # noqa: E402

LAYER = 1  # of 2: exercises the per-layer buffer offset
N_HEADS = 4
MAX_SPLITS = 4
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}

# (dtype, head_dim, GQA group, page_size); n_kv_heads = N_HEADS // group
CASES = [
    (torch.float32, 64, 1, 1),
    (torch.float32, 128, 2, 16),
    (torch.float32, 64, 4, 16),
    (torch.float16, 128, 4, 1),
    (torch.float16, 64, 2, 16),
    (torch.float32, 24, 2, 1),  # head_dim not a power of two: padded and masked
]


def triton_config(q_tile: int = 8, min_tokens: int = 64, rows: int = 4) -> TritonConfig:
    return TritonConfig(
        prefill_q_tile=q_tile, max_decode_splits=MAX_SPLITS, decode_split_min_tokens=min_tokens, max_rows=rows
    )


def case_id(case: tuple) -> str:
    dtype, dim, group, page = case
    return f"{str(dtype).removeprefix('torch.')}-d{dim}-g{group}-p{page}"


class Pair:
    """The same KV contents for the Triton backend (in ``dtype``) and the fp32 torch reference."""

    def __init__(self, dtype: torch.dtype, head_dim: int, group: int, page_size: int) -> None:
        self.dtype = dtype
        self.n_kv = N_HEADS // group
        self.head_dim = head_dim
        self.layout = PagedLayout(page_size, n_pages=96 // page_size + 2, rows=4, context=64)
        self.storage = make_storage(2, self.layout.allocator.n_pages * page_size, self.n_kv, head_dim, dtype)
        self.ref = SimpleNamespace(
            k_buffer=self.storage.k_buffer.float(), v_buffer=self.storage.v_buffer.float(), k_scale=None, v_scale=None
        )
        self.triton = self.triton_with()
        self.torch = TorchNativeBackend(N_HEADS, self.n_kv, head_dim)

    def triton_with(self, q_tile: int = 8, min_tokens: int = 64) -> TritonBackend:
        """A Triton backend for this pair's heads, planning with these tile and split sizes."""
        return TritonBackend(N_HEADS, self.n_kv, self.head_dim, triton_config(q_tile, min_tokens), "cpu")

    def qkv(self, n_tokens: int) -> tuple[torch.Tensor, ...]:
        q = torch.randn(n_tokens, N_HEADS, self.head_dim).to(self.dtype)
        k = torch.randn(n_tokens, self.n_kv, self.head_dim).to(self.dtype)
        v = torch.randn(n_tokens, self.n_kv, self.head_dim).to(self.dtype)
        return q, k, v

    def run(
        self, make_view, qkv: tuple[torch.Tensor, ...], triton: TritonBackend, window: int | None = None, adjust=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Triton output (its plan changed by ``adjust`` when given) and fp32 reference output of one
        forward (both within ``window``); checks the stored k/v too."""
        q, k, v = qkv
        view = make_view(self.storage)
        plan = triton.plan(view)
        out = triton.forward(q, k, v, LAYER, plan if adjust is None else adjust(plan), window)
        ref = self.torch.forward(q.float(), k.float(), v.float(), LAYER, make_view(self.ref), window)
        loc = view.out_cache_loc
        assert torch.equal(self.storage.k_buffer[LAYER, loc], k)
        assert torch.equal(self.storage.v_buffer[LAYER, loc], v)
        assert out.dtype == self.dtype and out.shape == q.shape
        return out.float(), ref

    def prefill(
        self, rows: list[int], prefix: list[int], extend: list[int], q_tile: int = 8, window: int | None = None
    ):
        loc = torch.cat(self.layout.extend_interleaved(rows, extend))
        table = self.layout.pool.table
        triton = self.triton_with(q_tile=q_tile)
        return self.run(
            lambda s: make_prefill_view(s, table, rows, prefix, extend, loc), self.qkv(sum(extend)), triton, window
        )

    def decode(
        self,
        rows: list[int],
        min_tokens: int,
        loc: torch.Tensor,
        qkv: tuple,
        num_splits: list[int] | None = None,
        window: int | None = None,
    ):
        seq_lens = [self.layout.lens[r] for r in rows]
        table = self.layout.pool.table

        def view(s):
            return make_decode_view(s, table, rows, seq_lens, loc)

        def forced_splits(plan):
            return replace(plan, num_splits=torch.tensor(num_splits, dtype=torch.int32))

        triton = self.triton_with(min_tokens=min_tokens)
        return self.run(view, qkv, triton, window, None if num_splits is None else forced_splits)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefill_then_decode_match_torch(case: tuple) -> None:
    dtype = case[0]
    tol = TOLERANCE[dtype]
    pair = Pair(*case)
    rows = [pair.layout.new_row() for _ in range(3)]
    prefix, extend = [0, 5, 19], [7, 1, 12]  # fresh prompt, one-token extend, two q tiles on a prefix
    pair.layout.extend_interleaved(rows, prefix)  # cached prefix: random k/v already in the storage
    out, ref = pair.prefill(rows, prefix, extend)
    assert (out - ref).abs().max().item() <= tol

    loc = torch.cat(pair.layout.extend_interleaved(rows, [1, 1, 1]))  # lens 8, 7, 32
    used = torch.cat([pair.layout.pool.table[r, : pair.layout.lens[r]] for r in rows])
    assert used.unique().numel() == used.numel() == 47 and bool((used > 0).all())
    qkv = pair.qkv(3)
    single, ref = pair.decode(rows, min_tokens=64, loc=loc, qkv=qkv)
    assert (single - ref).abs().max().item() <= tol
    split, ref = pair.decode(rows, min_tokens=3, loc=loc, qkv=qkv)  # 3, 3 and 4 (capped) splits
    assert (split - ref).abs().max().item() <= tol
    assert (split - single).abs().max().item() <= (1e-5 if dtype == torch.float32 else tol)


@pytest.mark.parametrize("window", [1, 5, 8, 50])
def test_sliding_window_prefill_then_decode_match_torch(window: int) -> None:
    """Windows of one key, a few keys (crossing q tiles, KV chunks and the cached prefix) and one
    wider than every context: prefill from scratch and over a cached prefix, then decode."""
    torch.manual_seed(window)
    pair = Pair(torch.float32, 32, 2, 1)
    rows = [pair.layout.new_row() for _ in range(3)]
    prefix, extend = [0, 11, 23], [21, 9, 1]  # from scratch (3 q tiles), over prefixes, a one-token extend
    pair.layout.extend_interleaved(rows, prefix)  # cached prefix: random k/v already in the storage
    out, ref = pair.prefill(rows, prefix, extend, window=window)
    assert (out - ref).abs().max().item() <= 1e-4

    loc = torch.cat(pair.layout.extend_interleaved(rows, [1, 1, 1]))  # lens 22, 21, 25
    qkv = pair.qkv(3)
    single, ref = pair.decode(rows, min_tokens=64, loc=loc, qkv=qkv, window=window)
    assert (single - ref).abs().max().item() <= 1e-4
    split, ref = pair.decode(rows, min_tokens=3, loc=loc, qkv=qkv, window=window)  # more splits than window keys
    assert (split - ref).abs().max().item() <= 1e-4
    if window < 20:  # the window mattered: the global decode differs
        dense, _ = pair.decode(rows, min_tokens=64, loc=loc, qkv=qkv)
        assert (dense - single).abs().max().item() > 1e-3


def test_sliding_window_chunked_prefill_equals_one_shot() -> None:
    """Chunks whose first rows start past the window of the cached prefix attend like one pass."""
    pair = Pair(torch.float16, 64, 4, 16)
    whole_row, chunk_row = pair.layout.new_row(), pair.layout.new_row()
    torch.manual_seed(2)
    q, k, v = pair.qkv(30)
    triton = pair.triton_with(q_tile=4)
    outs = []
    for row, chunks in ((whole_row, [30]), (chunk_row, [9, 1, 20])):
        start, parts = 0, []
        for n in chunks:
            loc = pair.layout.extend(row, n)
            view = make_prefill_view(pair.storage, pair.layout.pool.table, [row], [start], [n], loc)
            chunk = slice(start, start + n)
            parts.append(triton.forward(q[chunk], k[chunk], v[chunk], 0, triton.plan(view), 6))
            start += n
        outs.append(torch.cat(parts))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-3


def test_chunked_prefill_equals_one_shot() -> None:
    """A prompt computed in chunks over its own cached prefix attends exactly like in one pass."""
    pair = Pair(torch.float32, 64, 2, 16)
    whole_row, chunk_row = pair.layout.new_row(), pair.layout.new_row()
    torch.manual_seed(1)
    q, k, v = pair.qkv(21)
    triton = pair.triton_with(q_tile=4)
    outs = []
    for row, chunks in ((whole_row, [21]), (chunk_row, [6, 1, 14])):
        start, parts = 0, []
        for n in chunks:
            loc = pair.layout.extend(row, n)
            view = make_prefill_view(pair.storage, pair.layout.pool.table, [row], [start], [n], loc)
            chunk = slice(start, start + n)
            parts.append(triton.forward(q[chunk], k[chunk], v[chunk], 0, triton.plan(view)))
            start += n
        outs.append(torch.cat(parts))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


def test_decode_with_more_splits_than_tokens() -> None:
    """Empty splits (num_splits > context) carry no weight."""
    pair = Pair(torch.float32, 64, 2, 1)
    rows = [pair.layout.new_row() for _ in range(2)]
    pair.layout.extend_interleaved(rows, [1, 2])
    loc = torch.cat(pair.layout.extend_interleaved(rows, [1, 1]))  # lens 2, 3
    out, ref = pair.decode(rows, min_tokens=1, loc=loc, qkv=pair.qkv(2), num_splits=[MAX_SPLITS, MAX_SPLITS])
    assert (out - ref).abs().max().item() <= 1e-4


def test_unsupported_calls_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        TritonBackend(4, 2, 512, triton_config(), "cpu")
    pair = Pair(torch.float32, 64, 2, 1)
    rows = [pair.layout.new_row() for _ in range(2)]
    loc = pair.layout.extend(rows[0], 3)
    view = make_prefill_view(pair.storage, pair.layout.pool.table, rows[:1], [0], [3], loc)
    q, k, v = pair.qkv(3)
    with pytest.raises(ValueError, match="bfloat16"):
        bf16 = SimpleNamespace(
            k_buffer=pair.storage.k_buffer.bfloat16(),
            v_buffer=pair.storage.v_buffer.bfloat16(),
            k_scale=None,
            v_scale=None,
        )
        bf16_view = make_prefill_view(bf16, pair.layout.pool.table, rows[:1], [0], [3], loc)
        pair.triton.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0, pair.triton.plan(bf16_view))
    with pytest.raises(ValueError, match="its own plan"):
        pair.triton.forward(q, k, v, 0, view)
    loc = torch.cat([loc[:1], pair.layout.extend(rows[1], 1)])
    two = make_decode_view(pair.storage, pair.layout.pool.table, rows, [3, 1], loc)
    one_row = TritonBackend(N_HEADS, pair.n_kv, 64, triton_config(rows=1), "cpu")
    with pytest.raises(ValueError, match="max_rows 1"):
        one_row.plan(two)
    monkeypatch.setattr(triton_backend, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        TritonBackend(4, 2, 64, triton_config(), "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        pair.triton.forward(q, k, v, 0, pair.triton.plan(view))


def test_kernels_are_interpreted_on_cpu() -> None:
    assert triton_backend.INTERPRETED, "TRITON_INTERPRET=1 must be set before tokenmill.attention.triton is imported"
