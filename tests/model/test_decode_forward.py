"""The C++ decode forward (one call for the whole forward of a decode step) against the Python
forward it replaces: identical logits and cache contents step after step, in fp32 and bf16, on
every product path (skinny, panel, plain oneDNN / ``F.linear``, blocked oneDNN weights), tied and
untied LM heads; the runner takes it on every decode step of an engine run; and it is built only
where both the backend and the model allow it."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.model.test_parity import KVHarness
from tests.tiny_models import save_tiny_checkpoint, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention.cpu_backend import CpuBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.storage import KVStorage, ReqToTokenPool
from tokenmill.distributed.executor import Executor
from tokenmill.hardware import native_bf16
from tokenmill.kernels import linear as linear_module
from tokenmill.kernels import quant_linear as quant_linear_module
from tokenmill.kernels.linear import PANEL_MAX_ROWS, SKINNY_MAX_ROWS
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.kernels.quant_linear import STREAM_MAX_ROWS
from tokenmill.model import decode_forward as decode_forward_module
from tokenmill.model.blocks import Attention, DecoderLayer, GatedMLP
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.decode_forward import CpuDecodeForward
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.quantization import quantize_model, set_activation_passes
from tokenmill.model.registry import load_model_config

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler to build the CPU kernels")

MAX_ROWS = 16
NEEDS_NATIVE_BF16 = pytest.mark.skipif(
    not native_bf16(), reason="oneDNN's blocked bf16 weights need a CPU with AVX512-BF16 or AMX"
)


def cpu_harness(model: CausalLM) -> KVHarness:
    harness = KVHarness(model, n_slots=1024)
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    harness.storage = KVStorage(cfg.num_layers, 1024, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    harness.pool = ReqToTokenPool(MAX_ROWS, 256, "cpu")
    model.backend = CpuBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return harness


def greedy_decode(model: CausalLM, n_requests: int, steps: int, fused: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of each decode step of a ragged batch (through the C++ decode forward when ``fused``,
    else the Python forward), and the cache's written slots (the rest is uninitialized memory)."""
    harness = cpu_harness(model)
    rows = list(range(n_requests))
    prompts = [[(7 * r + 3 * i) % 90 + 4 for i in range(3 + 2 * r)] for r in rows]
    logits = harness.extend(rows, prompts, [0] * n_requests)
    if fused:  # the harness calls model(input_ids, positions, view): the decode forward's signature
        decode = CpuDecodeForward.build(model, model.backend, harness.storage.k_buffer.dtype)
        assert decode is not None and decode.can_run(n_requests)
        harness.model = decode
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
    save_tiny_checkpoint(path, "llama", num_key_value_heads=2, tie_word_embeddings=False)
    return path


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("decode-forward-tied-llama")
    save_tiny_checkpoint(path, "llama", num_key_value_heads=2, tie_word_embeddings=True)
    return path


@pytest.mark.parametrize(
    "dtype, blocked_min_rows, n_requests",
    [
        (torch.float32, {}, 1),
        (torch.float32, {}, SKINNY_MAX_ROWS),
        (torch.float32, {}, SKINNY_MAX_ROWS + 3),  # panel
        (torch.float32, {torch.float32: 2}, 1),  # skinny below the blocked minimum
        (torch.float32, {torch.float32: 2}, 5),
        (torch.bfloat16, {}, 1),
        (torch.bfloat16, {}, 5),  # F.linear
        pytest.param(torch.bfloat16, {torch.bfloat16: 1}, 1, marks=NEEDS_NATIVE_BF16),
        pytest.param(torch.bfloat16, {torch.bfloat16: 1}, 5, marks=NEEDS_NATIVE_BF16),
    ],
)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_python_layers(
    llama: Path,
    tied_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    blocked_min_rows: dict,
    n_requests: int,
    tied: bool,
) -> None:
    monkeypatch.setattr(linear_module, "BLOCKED_MIN_ROWS", blocked_min_rows)
    model = load_model(tied_llama if tied else llama, dtype, "cpu")
    expect_blocked = n_requests >= blocked_min_rows.get(dtype, n_requests + 1)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert (qkv.blocked_weight(dtype, n_requests) is not None) == expect_blocked
    fused, fused_cache = greedy_decode(model, n_requests, steps=5, fused=True)
    python, python_cache = greedy_decode(model, n_requests, steps=5, fused=False)
    for step, (a, b) in enumerate(zip(fused, python)):
        assert a.dtype == dtype
        assert torch.equal(a, b), f"decode step {step}: max diff {(a - b).abs().max().item()}"
    assert torch.equal(fused_cache, python_cache)


@pytest.mark.parametrize("scheme", [QuantScheme(8), QuantScheme(4, 32, symmetric=False)], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_requests, stream_max_rows", [(1, STREAM_MAX_ROWS), (5, STREAM_MAX_ROWS), (5, 4)])
@pytest.mark.parametrize("passes", [2, 1])
def test_quantized_projections_match_python_layers(
    llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    scheme: QuantScheme,
    dtype: torch.dtype,
    n_requests: int,
    stream_max_rows: int,
    passes: int,
) -> None:
    """Quantized projections in the C++ decode forward: streamed, or (more rows than the streaming
    limit, lowered here to fit the harness's rows) dequantized for oneDNN; in the panels layout (bf16
    with an int8 path) with the model's activation passes."""
    monkeypatch.setattr(quant_linear_module, "STREAM_MAX_ROWS", stream_max_rows)
    monkeypatch.setattr(decode_forward_module, "STREAM_MAX_ROWS", stream_max_rows)
    model = load_model(llama, dtype, "cpu")
    quantize_model(model, scheme)
    set_activation_passes(model, passes)
    fused, fused_cache = greedy_decode(model, n_requests, steps=4, fused=True)
    python, python_cache = greedy_decode(model, n_requests, steps=4, fused=False)
    for step, (a, b) in enumerate(zip(fused, python)):
        assert torch.equal(a, b), f"decode step {step}: max diff {(a - b).abs().max().item()}"
    assert torch.equal(fused_cache, python_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_python_layers(tmp_path: Path, dtype: torch.dtype) -> None:
    """Each layer's window goes to the kernel's attention: contexts grow to four times the window."""
    save_tiny_model(tmp_path, "mistral", num_key_value_heads=2, sliding_window=4)
    model = load_model(tmp_path, dtype, "cpu")
    weights = model.cpu_decode_weights()
    assert weights is not None and weights.windows == [4] * model.config.num_layers
    fused, fused_cache = greedy_decode(model, 5, steps=6, fused=True)
    python, python_cache = greedy_decode(model, 5, steps=6, fused=False)
    for step, (a, b) in enumerate(zip(fused, python)):
        assert torch.equal(a, b), f"decode step {step}: max diff {(a - b).abs().max().item()}"
    assert torch.equal(fused_cache, python_cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_runs_it_on_every_decode_step(llama: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """Every pure decode step of an engine run goes through the C++ decode forward, no other step
    does, and the tokens and logprobs equal those of the same run on the Python forward."""
    steps: list[tuple[bool, int]] = []  # per forward: (pure decode step, C++ decode forward calls)
    calls = []
    run_forward, run_fused = Executor.execute, CpuDecodeForward.__call__

    def forward(self: Executor, step) -> torch.Tensor:
        before = len(calls)
        logits = run_forward(self, step)
        steps.append((step.is_decode, len(calls) - before))
        return logits

    def fused(self: CpuDecodeForward, *args: object) -> torch.Tensor:
        calls.append(1)
        return run_fused(self, *args)

    monkeypatch.setattr(Executor, "execute", forward)
    monkeypatch.setattr(CpuDecodeForward, "__call__", fused)
    prompts = [[5, 6, 7], [(7 * i) % 90 + 4 for i in range(19)], [8, 9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    llm = LLM(
        dtype=dtype,
        model=str(llama),
        device="cpu",
        attention_backend="cpu",
        num_kv_slots=512,
        enable_prefix_caching=False,
    )
    try:
        assert llm.engine.worker.cpu_decode is not None
        with_fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert all(n == int(pure) for pure, n in steps) and sum(n for _, n in steps) > 0
        llm.engine.worker.cpu_decode = None
        python = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    for a, b in zip(with_fused, python):
        assert a.token_ids == b.token_ids
        assert [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)] == [
            lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)
        ]


def test_can_run(llama: Path) -> None:
    model = load_model(llama, torch.float32, "cpu")
    cfg = model.config
    backend = CpuBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    decode = CpuDecodeForward.build(model, backend, torch.float32)
    blocked_fp32 = torch.float32 in linear_module.BLOCKED_MIN_ROWS  # no row limit: oneDNN takes any count
    assert decode is not None and decode.can_run(1) and decode.can_run(PANEL_MAX_ROWS)
    assert not decode.can_run(0) and decode.can_run(PANEL_MAX_ROWS + 1) == blocked_fp32
    bf16_cache = CpuDecodeForward.build(model, backend, torch.bfloat16)
    assert bf16_cache is not None and not bf16_cache.can_run(1)  # the cache must have the model's dtype
    model.to(torch.bfloat16)
    assert bf16_cache.can_run(1) and bf16_cache.can_run(4 * PANEL_MAX_ROWS) and not decode.can_run(1)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", dict(attention_bias=True)),
        ("llama", dict(mlp_bias=True)),
        ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
        ("qwen2", {}),
        ("qwen3", dict(attention_bias=False)),
    ],
    ids=["qkv-bias", "mlp-bias", "dynamic-rope", "qwen2", "qwen3"],
)
def test_declines_what_it_does_not_cover(tmp_path: Path, kind: str, overrides: dict) -> None:
    save_tiny_model(tmp_path, kind, **overrides)
    model = load_model(tmp_path, torch.float32, "cpu")
    cfg = model.config
    assert model.cpu_decode_weights() is None
    assert (
        CpuDecodeForward.build(model, CpuBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), torch.float32) is None
    )


def test_declines_the_torch_backend(llama: Path) -> None:
    model = load_model(llama, torch.float32, "cpu")
    cfg = model.config
    assert model.cpu_decode_weights() is not None
    assert (
        CpuDecodeForward.build(model, TorchNativeBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), torch.float32)
        is None
    )


class _LlamaWithQKNorm(LlamaForCausalLM):
    """An opted-in family whose instance has q/k norms: the layer allow-list must refuse it."""

    def decoder_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        attention = Attention(config, layer_id, qkv_bias=False, o_bias=False, qk_norm=True)
        return DecoderLayer(config, attention, GatedMLP(config.hidden_size, config.intermediate_size, False))


class _UnmodelledFamily(LlamaForCausalLM):
    """Llama's parameters, but a family that did not opt in (it might compute something else)."""

    capabilities = replace(LlamaForCausalLM.capabilities, cpu_decode_forward=False)


@pytest.mark.parametrize("family", [_LlamaWithQKNorm, _UnmodelledFamily])
def test_declines_qk_norms_and_families_that_did_not_opt_in(llama: Path, family: type[CausalLM]) -> None:
    with torch.device("meta"):
        model = family(load_model_config(llama))
    cfg = model.config
    backend = CpuBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert CpuDecodeForward.build(model, backend, torch.float32) is None
