"""A tiny llama through TritonBackend (Triton interpreter on CPU) against the torch-native backend:
the engine end to end (paged, chunked prefill, mixed steps, split-KV decode, prefix hits), and the
CUDA-graph runner's padded static-buffer decode path run eagerly; both also for a tiny mistral
whose layers slide (window 5, shorter than the prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton")

from tests.tiny_models import save_tiny_checkpoint  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.attention.torch_native import TorchNativeBackend  # noqa: E402
from tokenmill.attention.triton import TritonBackend  # noqa: E402
from tokenmill.attention.triton.config import TritonConfig  # noqa: E402
from tokenmill.cache.manager import CacheManager  # noqa: E402
from tokenmill.cache.storage import KVStorage, ReqToTokenPool  # noqa: E402
from tokenmill.cache.view_binder import ViewBinder  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine.sequence import Sequence  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.worker.cuda_graphs import CudaGraphDecodeRunner, batch_buckets  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    save_tiny_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def windowed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-mistral-window-triton")
    save_tiny_checkpoint(path, "mistral", sliding_window=5)
    return path


@pytest.mark.parametrize("model_fixture", ["checkpoint", "windowed_checkpoint"])
def test_engine_greedy_tokens_match_torch_backend(request: pytest.FixtureRequest, model_fixture: str) -> None:
    checkpoint = request.getfixturevalue(model_fixture)
    prompts = [list(range(3, 8)), [(7 * i) % 90 + 4 for i in range(19)], [(5 * i) % 80 + 6 for i in range(34)]]
    followup = prompts[2][:20] + [9, 8, 7]  # shares the first (cached) 16-token page of prompt 3
    options = dict(
        device="cpu",
        num_kv_slots=256,
        page_size=16,
        max_running_requests=4,
        max_num_batched_tokens=24,
        max_decode_splits=2,
        decode_split_min_tokens=8,
        cuda_graphs=False,
    )
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(dtype="float32", model=str(checkpoint), attention_backend=backend, **options)
        try:
            assert llm.engine.model.backend.name == backend
            first = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
            (second,) = llm.generate([followup], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
            stats = llm.engine.stats()
        finally:
            llm.shutdown()
        assert second.num_cached_tokens == 16
        assert stats["scheduler"]["chunked_prefills"] > 0 and stats["scheduler"]["mixed_steps"] > 0
        results[backend] = [o.outputs[0].token_ids for o in first] + [second.outputs[0].token_ids]
    assert results["triton"] == results["torch"]


def new_seq(tokens: list[int]) -> Sequence:
    return Sequence(prompt_token_ids=tokens, params=SamplingParams(max_tokens=8))


@pytest.mark.parametrize("model_fixture", ["checkpoint", "windowed_checkpoint"])
def test_cuda_graph_static_decode_matches_eager(request: pytest.FixtureRequest, model_fixture: str) -> None:
    """The runner's padded static view (run eagerly on CPU) gives the eager decode's logits and
    touches no KV slot but the reserved slot 0; logits of both backends agree to 1e-4."""
    model = load_model(request.getfixturevalue(model_fixture), torch.float32, "cpu")
    cfg = model.config
    assert (cfg.layer_sliding_window(0) == 5) == (model_fixture == "windowed_checkpoint")
    config = EngineConfig(device="cpu", page_size=16, max_running_requests=8, cuda_graph_max_batch=6)
    storage = KVStorage(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    storage.k_buffer.zero_()  # defined contents, to see exactly which slots get written
    storage.v_buffer.zero_()
    pool = ReqToTokenPool(8, 64, "cpu")
    cache, views = CacheManager(config, storage.n_slots, pool), ViewBinder(storage, pool.table)
    triton_config = TritonConfig(prefill_q_tile=16, max_decode_splits=2, decode_split_min_tokens=8, max_rows=8)
    triton_backend = TritonBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, triton_config, "cpu")
    torch_backend = TorchNativeBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    seqs = [new_seq(list(range(4, 4 + n))) for n in (3, 18, 9)]
    for seq in seqs:
        assert cache.alloc(seq.kv, seq.all_token_ids)
    lens = [len(s.prompt_token_ids) for s in seqs]
    loc = torch.cat([cache.extend(s.kv, n) for s, n in zip(seqs, lens)])
    view = views.prefill([s.row for s in seqs], [0] * len(seqs), lens, loc)
    ids = torch.tensor([t for s in seqs for t in s.prompt_token_ids])
    pos = torch.cat([torch.arange(n) for n in lens])
    model.backend = torch_backend
    ref = model(ids, pos, view)
    model.backend = triton_backend
    assert (model(ids, pos, view) - ref).abs().max().item() <= 1e-4

    kvs = [s.kv for s in seqs]
    loc = cache.extend_decode(kvs)
    view = views.decode([s.row for s in seqs], [s.n_kv for s in seqs], loc)
    last = torch.tensor([s.prompt_token_ids[-1] for s in seqs])
    positions = view.seq_lens - 1
    model.backend = torch_backend
    ref = model(last, positions, view)
    model.backend = triton_backend
    eager = model(last, positions, view)
    assert (eager - ref).abs().max().item() <= 1e-4

    runner = CudaGraphDecodeRunner(model, storage, pool.table, config)
    assert runner.buckets == batch_buckets(6) == [1, 2, 4, 6] and runner.bucket(3) == 4 and not runner.can_run(7)
    k_before, v_before = storage.k_buffer.clone(), storage.v_buffer.clone()
    runner._load(last, positions, view, 4)
    static = runner._forward(4, runner._plan(4))
    assert (static[:3] - eager).abs().max().item() <= 1e-5
    moved = ((storage.k_buffer - k_before).abs() + (storage.v_buffer - v_before).abs()).flatten(2).amax((0, 2))
    assert (moved > 1e-5).nonzero().flatten().tolist() == [0]  # the padded entry wrote only the dummy slot
