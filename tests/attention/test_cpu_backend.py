"""CpuBackend (C++ decode kernel, fused-softmax prefill) against the torch-native backend, and
through the engine.

Ragged decode batches over scattered pages (page sizes 1 and 16), GQA groups 1-5 and 8, head_dim 64
and 128 (compile-time paths) and 24/40 (run-time path), batches small enough to split work by
KV head and large enough to split it by request; contexts split into several chunks, each
request's output identical alone and in a batch; the one-token rows of a mixed prefill step;
prompt rows over cached prefixes through the prefill kernel (fp32 against the torch backend, bf16
against eager bf16 attention) and through the matmul path in one or several query blocks; the fused
softmax on bf16 scores.
The kernels build on first use; without a C++ compiler the tests are skipped (and only then).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.attention.helpers import PagedLayout, make_storage
from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.attention import cpu_backend
from tokenmill.attention.cpu_backend import CpuBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view
from tokenmill.kernels.cpu import load_cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")

LAYER = 1  # of 2: exercises the per-layer buffer offset

# (n_heads, n_kv_heads, head_dim, page_size, batch)
CASES = [
    (4, 4, 64, 1, 1),
    (12, 4, 64, 16, 9),
    (8, 4, 128, 1, 3),
    (12, 4, 128, 16, 3),  # groups of 3 at head_dim 128: the value pass's rows in a pass of 2 and 1
    (20, 4, 64, 16, 4),  # groups of 5 at head_dim 64: a pass of 4 rows and 1
    (16, 2, 64, 1, 3),  # groups of 8: two passes of 4
    (8, 2, 24, 16, 9),
    (4, 1, 40, 1, 5),
]


def test_kernels_build() -> None:
    assert load_cpu_kernels() is not None, "a C++ compiler is present, so the kernels must build (see the log)"


def backends(n_heads: int, n_kv: int, head_dim: int) -> tuple[CpuBackend, TorchNativeBackend]:
    return CpuBackend(n_heads, n_kv, head_dim), TorchNativeBackend(n_heads, n_kv, head_dim)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}-kv{}-d{}-p{}-b{}".format(*c))
def test_decode_matches_torch(case: tuple) -> None:
    n_heads, n_kv, head_dim, page, batch = case
    torch.manual_seed(0)
    layout = PagedLayout(page, n_pages=2 + 70 * batch // page + batch, rows=batch, context=96)
    storage = make_storage(2, layout.allocator.n_pages * page, n_kv, head_dim, torch.float32)
    rows = [layout.new_row() for _ in range(batch)]
    layout.extend_interleaved(rows, torch.randint(0, 64, (batch,)).tolist())  # cached context
    loc = torch.cat(layout.extend_interleaved(rows, [1] * batch))
    seq_lens = [layout.lens[r] for r in rows]
    view = make_decode_view(storage, layout.pool.table, rows, seq_lens, loc)
    q = torch.randn(batch, n_heads, head_dim)
    k, v = torch.randn(batch, n_kv, head_dim), torch.randn(batch, n_kv, head_dim)
    cpu, ref = backends(n_heads, n_kv, head_dim)
    expected = ref.forward(q, k, v, LAYER, view)
    out = cpu.forward(q, k, v, LAYER, view)
    assert out.shape == q.shape
    assert (out - expected).abs().max().item() <= 1e-5


# Context lengths spanning several of the kernel's 128-key chunks, with short requests beside them.
@pytest.mark.parametrize("context", [[700], [300, 5, 600], [257, 256, 1, 513, 40, 900]], ids=str)
def test_decode_long_contexts_match_torch_and_do_not_depend_on_the_batch(context: list[int]) -> None:
    """Requests longer than a chunk are split and merged; each request's output is bit for bit the
    one it gets alone (the split never depends on the rest of the batch)."""
    torch.manual_seed(2)
    n_heads, n_kv, head_dim, page, batch = 12, 4, 64, 16, len(context)
    layout = PagedLayout(page, n_pages=2 + sum(context) // page + 2 * batch, rows=batch, context=1024)
    storage = make_storage(2, layout.allocator.n_pages * page, n_kv, head_dim, torch.float32)
    rows = [layout.new_row() for _ in range(batch)]
    layout.extend_interleaved(rows, context)
    loc = torch.cat(layout.extend_interleaved(rows, [1] * batch))
    q = torch.randn(batch, n_heads, head_dim)
    k, v = torch.randn(batch, n_kv, head_dim), torch.randn(batch, n_kv, head_dim)
    cpu, ref = backends(n_heads, n_kv, head_dim)

    def view(index: list[int]):
        return make_decode_view(
            storage,
            layout.pool.table,
            [rows[i] for i in index],
            [layout.lens[rows[i]] for i in index],
            loc[index],
        )

    everyone = list(range(batch))
    out = cpu.forward(q, k, v, LAYER, view(everyone))
    assert (out - ref.forward(q, k, v, LAYER, view(everyone))).abs().max().item() <= 1e-5
    for i in everyone:
        alone = cpu.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], LAYER, view([i]))
        assert torch.equal(alone[0], out[i]), f"request {i} (context {context[i]}) changed with the batch"


def test_mixed_step_single_rows_match_torch() -> None:
    """Decode-like rows inside a prefill view take the kernel; the prompt rows the torch path."""
    torch.manual_seed(1)
    layout = PagedLayout(16, n_pages=20, rows=4, context=96)
    storage = make_storage(2, layout.allocator.n_pages * 16, 2, 64, torch.float32)
    rows = [layout.new_row() for _ in range(4)]
    prefix, extend = [30, 0, 17, 5], [1, 9, 1, 1]
    layout.extend_interleaved(rows, prefix)
    loc = torch.cat(layout.extend_interleaved(rows, extend))
    view = make_prefill_view(storage, layout.pool.table, rows, prefix, extend, loc)
    q, k, v = torch.randn(12, 6, 64), torch.randn(12, 2, 64), torch.randn(12, 2, 64)
    cpu, ref = backends(6, 2, 64)
    assert (cpu.forward(q, k, v, LAYER, view) - ref.forward(q, k, v, LAYER, view)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("block_floats", [cpu_backend.SCORE_BUFFER_FLOATS, 3 * 24 * 20])
def test_prefill_matmul_path_matches_torch(monkeypatch: pytest.MonkeyPatch, block_floats: int) -> None:
    """head_dim 24 (not a multiple of 16) takes the matmuls around the fused softmax: prompt rows
    (long enough for that path) over cached prefixes; a small score buffer forces several query
    blocks per request."""
    monkeypatch.setattr(cpu_backend, "SCORE_BUFFER_FLOATS", block_floats)
    torch.manual_seed(2)
    layout = PagedLayout(1, n_pages=400, rows=3, context=160)
    storage = make_storage(2, 400, 2, 24, torch.float32)
    rows = [layout.new_row() for _ in range(3)]
    prefix, extend = [0, 40, 3], [45, 33, 70]
    layout.extend_interleaved(rows, prefix)
    loc = torch.cat(layout.extend_interleaved(rows, extend))
    view = make_prefill_view(storage, layout.pool.table, rows, prefix, extend, loc)
    n = sum(extend)
    q, k, v = torch.randn(n, 6, 24), torch.randn(n, 2, 24), torch.randn(n, 2, 24)
    cpu, ref = backends(6, 2, 24)
    assert all(e >= cpu_backend.MIN_KERNEL_QUERY_ROWS for e in extend)
    assert (cpu.forward(q, k, v, LAYER, view) - ref.forward(q, k, v, LAYER, view)).abs().max().item() <= 1e-5


# (n_heads, n_kv_heads, head_dim, sliding window)
PREFILL_CASES = [(6, 2, 64, None), (12, 4, 64, 20), (8, 8, 128, None), (10, 2, 80, 50), (4, 1, 32, None)]


def prefill_problem(dtype: torch.dtype, n_heads: int, n_kv: int, head_dim: int) -> tuple:
    """A prefill view over scattered pages (page size 4): prompts with and without cached prefixes,
    of 1 to 70 rows (tiles of 16 positions and partial ones; two one-row requests go to the decode
    kernel, so the prefill kernel gets a subset of the requests), and q/k/v for its rows."""
    layout = PagedLayout(4, n_pages=200, rows=5, context=200)
    storage = make_storage(2, 800, n_kv, head_dim, dtype)
    rows = [layout.new_row() for _ in range(5)]
    prefix, extend = [0, 40, 3, 90, 0], [45, 1, 70, 1, 17]
    layout.extend_interleaved(rows, prefix)  # the cached prefixes' keys and values: the storage's random ones
    loc = torch.cat(layout.extend_interleaved(rows, extend))
    view = make_prefill_view(storage, layout.pool.table, rows, prefix, extend, loc)
    n = sum(extend)
    q, k, v = (torch.randn(n, h, head_dim).to(dtype) for h in (n_heads, n_kv, n_kv))
    return view, q, k, v


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "h{}-kv{}-d{}-w{}".format(*c))
def test_prefill_kernel_matches_torch(case: tuple) -> None:
    n_heads, n_kv, head_dim, window = case
    torch.manual_seed(5)
    view, q, k, v = prefill_problem(torch.float32, n_heads, n_kv, head_dim)
    cpu, ref = backends(n_heads, n_kv, head_dim)
    expected = ref.forward(q, k, v, LAYER, view, window)
    assert (cpu.forward(q, k, v, LAYER, view, window) - expected).abs().max().item() <= 1e-5


def eager_bf16_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, window: int | None):
    """transformers' eager attention in bf16 for one request: bf16 scores, fp32 softmax of the
    scaled scores, bf16 probabilities, bf16 output (fp32 sums)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (t.repeat_interleave(group, 1).transpose(0, 1).float() for t in (keys, values))
    scores = (q.transpose(0, 1).float() @ keys.transpose(1, 2)).bfloat16().float()
    position = torch.arange(prefix, prefix + q.shape[0])[:, None]
    key = torch.arange(keys.shape[1])[None, :]
    visible = (key <= position) & (key > position - window if window else True)
    probs = (scores * q.shape[2] ** -0.5).masked_fill(~visible, float("-inf")).softmax(-1).bfloat16().float()
    return (probs @ values).transpose(0, 1).bfloat16()


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "h{}-kv{}-d{}-w{}".format(*c))
def test_bf16_prefill_kernel_rounds_like_eager_attention(case: tuple) -> None:
    """In bf16 the kernel's outputs are transformers' eager bf16 attention's on the same values, up to
    the order of fp32 sums (a bf16 unit in the last place)."""
    n_heads, n_kv, head_dim, window = case
    torch.manual_seed(6)
    view, q, k, v = prefill_problem(torch.bfloat16, n_heads, n_kv, head_dim)
    out = backends(n_heads, n_kv, head_dim)[0].forward(q, k, v, LAYER, view, window)
    assert out.dtype == torch.bfloat16
    starts = view.qo_indptr.tolist()
    requests = zip(view.req_pool_indices.tolist(), view.prefix_lens_cpu, view.extend_lens_cpu)
    for i, (row, prefix, n) in enumerate(requests):
        if n == 1:
            continue  # a decode-like row: the decode kernel's (fp32) math, tested above
        slots = view.req_to_token[row, : prefix + n].long()
        keys, values = view.k_buffer[LAYER][slots], view.v_buffer[LAYER][slots]
        expected = eager_bf16_attention(q[starts[i] : starts[i] + n], keys, values, prefix, window)
        got = out[starts[i] : starts[i] + n].float()
        assert torch.allclose(got, expected.float(), rtol=2**-7, atol=4e-3), f"request {i}"


@pytest.mark.parametrize("first_pos, window", [(0, 0), (13, 0), (5, 7)])
def test_bf16_causal_softmax_is_the_fp32_one_rounded_once(first_pos: int, window: int) -> None:
    """bf16 scores in place: each probability is the fp32 kernel's on the same values, rounded to
    bf16 once (rows of 1 to 70 visible keys: whole 16-wide vectors and tails)."""
    torch.manual_seed(4)
    kernels = load_cpu_kernels()
    scores = (torch.randn(3, 57, first_pos + 57) * 4).bfloat16()
    expected = scores.float()
    kernels.causal_softmax_(expected, first_pos, 0.3, window)
    kernels.causal_softmax_(scores, first_pos, 0.3, window)
    assert torch.equal(scores, expected.bfloat16())


def test_refuses_fp16() -> None:
    layout = PagedLayout(1, n_pages=8, rows=1, context=8)
    storage = make_storage(2, 8, 2, 64, torch.float16)
    row = layout.new_row()
    loc = layout.extend(row, 1)
    view = make_decode_view(storage, layout.pool.table, [row], [1], loc)
    q, kv = torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half()
    with pytest.raises(ValueError, match="fp32/bf16"):
        CpuBackend(2, 2, 64).forward(q, kv, kv, 0, view)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}-kv{}-d{}-p{}-b{}".format(*c))
def test_bf16_decode_matches_fp32_math_on_the_same_values(case: tuple) -> None:
    """A bf16 cache is read as the fp32 values it holds: the output equals the fp32 reference on
    those values (and a bf16 query), rounded once to bf16."""
    n_heads, n_kv, head_dim, page, batch = case
    torch.manual_seed(3)
    layout = PagedLayout(page, n_pages=2 + 250 * batch // page + batch, rows=batch, context=300)
    bf16 = make_storage(2, layout.allocator.n_pages * page, n_kv, head_dim, torch.bfloat16)
    fp32 = make_storage(2, layout.allocator.n_pages * page, n_kv, head_dim, torch.float32)
    fp32.k_buffer.copy_(bf16.k_buffer)
    fp32.v_buffer.copy_(bf16.v_buffer)
    rows = [layout.new_row() for _ in range(batch)]
    layout.extend_interleaved(rows, torch.randint(0, 250, (batch,)).tolist())  # one to two 128-key chunks
    loc = torch.cat(layout.extend_interleaved(rows, [1] * batch))

    def view(storage):
        seq_lens = [layout.lens[r] for r in rows]
        return make_decode_view(storage, layout.pool.table, rows, seq_lens, loc)

    q = torch.randn(batch, n_heads, head_dim).bfloat16()
    k, v = torch.randn(batch, n_kv, head_dim).bfloat16(), torch.randn(batch, n_kv, head_dim).bfloat16()
    out = CpuBackend(n_heads, n_kv, head_dim).forward(q, k, v, LAYER, view(bf16))
    expected = TorchNativeBackend(n_heads, n_kv, head_dim).forward(q.float(), k.float(), v.float(), LAYER, view(fp32))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected.bfloat16().float(), rtol=2**-7, atol=1e-3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-cpu")
    save_tiny_checkpoint(path, "llama")
    return path


def test_engine_auto_picks_cpu_and_matches_torch(checkpoint: Path) -> None:
    prompts = [list(range(3, 8)), [(7 * i) % 90 + 4 for i in range(19)], [(5 * i) % 80 + 6 for i in range(34)]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", num_kv_slots=256, page_size=4, max_running_requests=4, max_num_batched_tokens=24)
    results = {}
    for backend in ("auto", "torch"):
        llm = LLM(dtype="float32", model=str(checkpoint), attention_backend=backend, **options)
        try:
            results[llm.engine.model.backend.name] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
            if backend == "auto":
                assert llm.engine.stats()["scheduler"]["mixed_steps"] > 0
        finally:
            llm.shutdown()
    assert set(results) == {"cpu", "torch"}
    assert results["cpu"] == results["torch"]
