"""Sliding-window attention (a query at position p sees keys p - W < k <= p) in the torch reference
and the CPU backend: both against a dense per-query oracle, the C++ kernels against the torch
reference, for decode batches (contexts shorter than, equal to and many times the window, over
several of the decode kernel's 128-key chunks), prompt rows over cached prefixes across the window
edge (the torch path and the fused-softmax path, one and several query blocks) and mixed steps.
A backend without windows refuses them."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from tests.attention.helpers import PagedLayout, make_storage
from tokenmill.attention import cpu_backend
from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.cpu_backend import CpuBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.storage import KVStorage
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view
from tokenmill.cache.views import KVView

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler for the CPU kernels")

LAYER = 1


def oracle(
    q: torch.Tensor, storage: KVStorage, table: torch.Tensor, rows: list[int], positions: list[int], window: int | None
) -> torch.Tensor:
    """Each query row over its request's keys in its window, one row at a time, in fp64."""
    n_heads, n_kv = q.shape[1], storage.k_buffer.shape[2]
    out = torch.empty_like(q)
    for t, (row, pos) in enumerate(zip(rows, positions)):
        first = 0 if window is None else max(0, pos - window + 1)
        slots = table[row, first : pos + 1].long()
        keys = storage.k_buffer[LAYER, slots].double()  # [S, Hkv, D]
        values = storage.v_buffer[LAYER, slots].double()
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            probs = torch.softmax(keys[:, kv] @ q[t, h].double() * q.shape[2] ** -0.5, dim=0)
            out[t, h] = (probs @ values[:, kv]).to(q.dtype)
    return out


def run(backend: AttentionBackend, view: KVView, window: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's output for random q/k/v of the view's tokens (stored by the call), and q."""
    gen = torch.Generator().manual_seed(seed)
    n = view.out_cache_loc.numel()
    q = torch.randn(n, backend.n_heads, backend.head_dim, generator=gen)
    k = torch.randn(n, backend.n_kv_heads, backend.head_dim, generator=gen)
    v = torch.randn(n, backend.n_kv_heads, backend.head_dim, generator=gen)
    return backend.forward(q, k, v, LAYER, view, window), q


def decode_case(contexts: list[int], page: int, n_kv: int, head_dim: int) -> tuple:
    layout = PagedLayout(page, n_pages=4 + sum(contexts) // page + 2 * len(contexts), rows=len(contexts), context=1024)
    storage = make_storage(2, layout.allocator.n_pages * page, n_kv, head_dim, torch.float32)
    rows = [layout.new_row() for _ in contexts]
    layout.extend_interleaved(rows, contexts)
    loc = torch.cat(layout.extend_interleaved(rows, [1] * len(rows)))
    seq_lens = [layout.lens[r] for r in rows]
    view = make_decode_view(storage, layout.pool.table, rows, seq_lens, loc)
    return storage, layout.pool.table, rows, [n - 1 for n in seq_lens], view


# (contexts before the decode token, window, page size, n_kv_heads, head_dim)
DECODE_CASES = [
    ([0, 5, 7, 8, 30, 61], 8, 1, 2, 64),
    ([3, 200, 40, 17], 12, 16, 1, 24),
    ([300, 129, 700, 5], 200, 16, 2, 64),  # windows over several 128-key chunks
    ([20] * 20, 9, 1, 2, 32),  # more than the torch path's DECODE_GROUP
    ([50, 1, 4], 1, 1, 2, 128),  # a window of one key: the token itself
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"w{c[1]}-p{c[2]}-kv{c[3]}-d{c[4]}")
def test_torch_decode_matches_oracle(case: tuple) -> None:
    contexts, window, page, n_kv, head_dim = case
    storage, table, rows, positions, view = decode_case(contexts, page, n_kv, head_dim)
    out, q = run(TorchNativeBackend(2 * n_kv, n_kv, head_dim), view, window, seed=0)
    assert (out - oracle(q, storage, table, rows, positions, window)).abs().max().item() <= 1e-5


@needs_compiler
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"w{c[1]}-p{c[2]}-kv{c[3]}-d{c[4]}")
def test_cpu_decode_kernel_matches_torch(case: tuple) -> None:
    contexts, window, page, n_kv, head_dim = case
    storage, table, rows, positions, view = decode_case(contexts, page, n_kv, head_dim)
    expected, _ = run(TorchNativeBackend(2 * n_kv, n_kv, head_dim), view, window, seed=0)
    out, q = run(CpuBackend(2 * n_kv, n_kv, head_dim), view, window, seed=0)
    assert (out - expected).abs().max().item() <= 1e-5
    global_out, _ = run(CpuBackend(2 * n_kv, n_kv, head_dim), view, None, seed=0)
    if max(contexts) >= window:  # the window mattered
        assert (global_out - out).abs().max().item() > 1e-3


def prefill_case(prefix: list[int], extend: list[int], page: int) -> tuple:
    layout = PagedLayout(page, n_pages=4 + (sum(prefix) + sum(extend)) // page + 2 * len(prefix), rows=4, context=256)
    storage = make_storage(2, layout.allocator.n_pages * page, 2, 64, torch.float32)
    rows = [layout.new_row() for _ in prefix]
    layout.extend_interleaved(rows, prefix)
    loc = torch.cat(layout.extend_interleaved(rows, extend))
    view = make_prefill_view(storage, layout.pool.table, rows, prefix, extend, loc)
    token_rows = [r for r, n in zip(rows, extend) for _ in range(n)]
    positions = [p + j for p, n in zip(prefix, extend) for j in range(n)]
    return storage, layout.pool.table, token_rows, positions, view


# (cached prefix lengths, query rows this step, window): prompts from scratch and over prefixes,
# chunks that start inside or past the window of their first row, rows long enough for the fused
# softmax path (>= MIN_KERNEL_QUERY_ROWS), short ones (torch path) and one-token rows (decode path)
PREFILL_CASES = [
    ([0, 40, 3], [45, 33, 70], 8),
    ([0, 12, 100], [40, 40, 36], 12),
    ([30, 0, 17, 5], [1, 9, 1, 1], 6),
    ([7, 0], [5, 3], 4),
    ([0, 64], [64, 32], 64),  # the window equals the context of the first prompt's last row
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"w{c[2]}-{c[0]}+{c[1]}")
def test_torch_prefill_matches_oracle(case: tuple) -> None:
    prefix, extend, window = case
    storage, table, rows, positions, view = prefill_case(prefix, extend, 16)
    out, q = run(TorchNativeBackend(4, 2, 64), view, window, seed=1)
    assert (out - oracle(q, storage, table, rows, positions, window)).abs().max().item() <= 1e-5


@needs_compiler
@pytest.mark.parametrize("block_floats", [cpu_backend.SCORE_BUFFER_FLOATS, 4 * 40 * 3])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"w{c[2]}-{c[0]}+{c[1]}")
def test_cpu_prefill_matches_torch(monkeypatch: pytest.MonkeyPatch, case: tuple, block_floats: int) -> None:
    """A small score buffer forces several query blocks per request, each reading from its own first key."""
    monkeypatch.setattr(cpu_backend, "SCORE_BUFFER_FLOATS", block_floats)
    prefix, extend, window = case
    storage, table, rows, positions, view = prefill_case(prefix, extend, 1)
    expected, _ = run(TorchNativeBackend(4, 2, 64), view, window, seed=1)
    out, _ = run(CpuBackend(4, 2, 64), view, window, seed=1)
    assert (out - expected).abs().max().item() <= 1e-5


class _GlobalOnly(TorchNativeBackend):
    capabilities = replace(TorchNativeBackend.capabilities, sliding_window=False)


def test_backend_without_windows_refuses_them() -> None:
    _, _, _, _, view = decode_case([10], 1, 2, 64)
    with pytest.raises(ValueError, match="sliding-window"):
        run(_GlobalOnly(4, 2, 64), view, 8, seed=0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        run(TorchNativeBackend(4, 2, 64), view, 0, seed=0)
