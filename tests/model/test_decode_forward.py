"""The C++ decode forward (one call for the whole forward of a decode step) against the Python
forward it replaces: identical logits and cache contents step after step, on the skinny (few
requests) and panel (more requests) linear paths; and it declines what it does not cover."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.model.test_parity import KVHarness
from tests.tiny_models import save_tiny_model
from tokenmill.attention.cpu_backend import CpuBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.storage import ReqToTokenPool
from tokenmill.cache.view_builder import make_decode_view
from tokenmill.model import transformer
from tokenmill.model.decode_forward import decode_forward
from tokenmill.kernels.linear import SKINNY_MAX_ROWS
from tokenmill.model.loader import load_model
from tokenmill.model.transformer import CausalLM

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")

MAX_ROWS = 16


def cpu_harness(model: CausalLM) -> KVHarness:
    harness = KVHarness(model, n_slots=1024)
    cfg = model.config
    harness.pool = ReqToTokenPool(MAX_ROWS, 256, "cpu")
    harness.partial_out = torch.zeros(MAX_ROWS, cfg.num_heads, 4, cfg.head_dim)
    harness.partial_lse = torch.zeros(MAX_ROWS, cfg.num_heads, 4)
    model.backend = CpuBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return harness


def greedy_decode(model: CausalLM, n_requests: int, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of each decode step of a ragged batch, and the cache's written slots (the rest is
    uninitialized memory)."""
    harness = cpu_harness(model)
    rows = list(range(n_requests))
    prompts = [[(7 * r + 3 * i) % 90 + 4 for i in range(3 + 2 * r)] for r in rows]
    logits = harness.extend(rows, prompts, [0] * n_requests)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    tokens = logits[ends].argmax(-1).tolist()
    lens = [len(p) + 1 for p in prompts]
    history = []
    for _ in range(steps):
        step = harness.decode(rows, tokens, lens)
        history.append(step)
        tokens, lens = step.argmax(-1).tolist(), [n + 1 for n in lens]
    written = slice(1, harness.next_slot)  # slot 0 is the allocator's dummy
    return history, torch.stack([harness.storage.k_buffer[:, written], harness.storage.v_buffer[:, written]])


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("decode-forward-llama")
    save_tiny_model(path, "llama", num_key_value_heads=2, tie_word_embeddings=False)
    return path


@pytest.mark.parametrize("n_requests", [1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 3])
def test_matches_python_layers(llama: Path, monkeypatch: pytest.MonkeyPatch, n_requests: int) -> None:
    model = load_model(llama, torch.float32, "cpu")
    ran = []

    def counted(*args: object) -> torch.Tensor | None:
        logits = decode_forward(*args)
        ran.append(logits is not None)
        return logits

    monkeypatch.setattr(transformer, "decode_forward", counted)
    fused, fused_cache = greedy_decode(model, n_requests, steps=5)
    assert ran == [False] + [True] * 5  # the prefill declined, every decode step ran it
    monkeypatch.setattr(transformer, "decode_forward", lambda *args: None)
    python, python_cache = greedy_decode(model, n_requests, steps=5)
    for step, (a, b) in enumerate(zip(fused, python)):
        assert torch.equal(a, b), f"decode step {step}: max diff {(a - b).abs().max().item()}"
    assert torch.equal(fused_cache, python_cache)


@pytest.mark.parametrize(
    "overrides",
    [dict(attention_bias=True), dict(mlp_bias=True), dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), {}],
    ids=["qkv-bias", "mlp-bias", "dynamic-rope", "torch-backend"],
)
def test_declines_what_it_does_not_cover(tmp_path: Path, overrides: dict) -> None:
    save_tiny_model(tmp_path, "llama", **overrides)
    model = load_model(tmp_path, torch.float32, "cpu")
    assert model.rotary.is_dynamic == ("rope_scaling" in overrides)
    harness = cpu_harness(model)
    if not overrides:
        model.backend = TorchNativeBackend(model.config.num_heads, model.config.num_kv_heads, model.config.head_dim)
    loc = harness._slots(0, 0, 1)
    view = make_decode_view(harness.storage, harness.pool.table, [0], [1], loc, harness.partial_out,
                            harness.partial_lse, 8)
    assert decode_forward(model, torch.tensor([3]), torch.zeros(1, dtype=torch.long), view) is None
