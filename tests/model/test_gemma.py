"""Gemma 2 and Gemma 3 through the engine against transformers' greedy ``generate``: windows of 8
crossed by every prompt, chunked prefill, prefix caching, attention backends "torch" and "auto"
(on CPU: "cpu", whose prefill kernel path and torch decode path soft-cap Gemma 2's scores).
Model-level parity (prefill logits, decode through the cache) is in test_parity.py; here also the
config rules (transformers' defaults, refusals) and the backends' soft-capping contract."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.model.test_parity import greedy_through_cache, hf_reference
from tests.tiny_models import save_tiny_checkpoint, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.attention.factory import BackendShape, build_backend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.config import EngineConfig
from tokenmill.model.capabilities import Combination, FamilyCapabilities, choose_backend
from tokenmill.model.config import ModelConfigError
from tokenmill.model.loader import load_model
from tokenmill.model.registry import load_model_config

NEW_TOKENS = 24
PROMPT_LENS = [30, 45, 70]

FAMILIES = {
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=8, sliding_window_pattern=2),
}

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler for the CPU kernels")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    """A tiny checkpoint, its prompts (one sharing 50 tokens with another) and transformers' greedy
    continuations of them."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_checkpoint(path, request.param, **FAMILIES[request.param])
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts.append(prompts[2][:50] + prompts[0][:10])
    return path, prompts, [hf_reference(hf_model, p)[1] for p in prompts]


def test_saved_config_names_the_registered_architecture(gemma: tuple) -> None:
    path, _, _ = gemma
    raw = json.loads((path / "config.json").read_text())
    config = load_model_config(path)
    assert raw["architectures"] == [config.architecture]
    assert config.sliding_window_layers == frozenset({0})  # layer 1 is global
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert config.attention_scale == raw["query_pre_attn_scalar"] ** -0.5
    assert (config.sliding_rope is not None) == (raw["model_type"] == "gemma3_text")


def test_chunked_prefill_across_the_window_matches_transformers(gemma: tuple) -> None:
    path, prompts, expected = gemma
    model = load_model(path, torch.float32, "cpu")
    for chunk in (5, 20):
        _, tokens = greedy_through_cache(model, prompts, chunk=chunk)
        assert tokens == expected


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=needs_compiler)])
def test_engine_matches_transformers(gemma: tuple, backend: str) -> None:
    path, prompts, expected = gemma
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cpu",
        attention_backend=backend,
        page_size=4,
        num_kv_slots=160,  # less than the requests need at once: preemption
        max_running_requests=4,
        max_num_batched_tokens=36,  # chunked prefill; chunks of 32+ rows take the cpu kernel path
        enable_prefix_caching=True,
    )
    try:
        expected_backend = "torch" if backend == "torch" else "cpu"
        assert llm.engine.model.backend.name == expected_backend
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats["cache"]["prefix_hit_tokens"] > 0
    assert stats["scheduler"]["preemptions"] > 0
    assert first == expected
    assert again == expected


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_transformers_defaults_and_v4_layout(tmp_path: Path) -> None:
    """Fields config.json omits take the config class's defaults; Gemma 3's transformers-4 RoPE
    fields (rope_theta + rope_scaling for global layers, rope_local_base_freq for local ones)."""
    save_tiny_model(tmp_path, "gemma3", head_dim=16, num_hidden_layers=7)
    raw = json.loads((tmp_path / "config.json").read_text())
    for name in ("rope_parameters", "layer_types", "sliding_window_pattern", "_sliding_window_pattern"):
        raw.pop(name, None)
    raw.pop("tie_word_embeddings")
    raw.pop("sliding_window")
    raw.update(rope_theta=5e5, rope_local_base_freq=123.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert config.tie_word_embeddings and config.sliding_window == 4096
    assert config.sliding_window_layers == frozenset({0, 1, 2, 3, 4, 6})  # every 6th layer is global
    assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == ("linear", 5e5, 8.0)
    assert (config.sliding_rope.rope_type, config.sliding_rope.theta) == ("default", 123.0)
    assert config.layer_rope(5) is config.rope and config.layer_rope(0) is config.sliding_rope


def test_gemma2_softcap_defaults_and_null(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "gemma2", head_dim=16)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["attn_logit_softcapping"], raw["final_logit_softcapping"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    _edit_config(tmp_path, attn_logit_softcapping=None, final_logit_softcapping=None)
    config = load_model_config(tmp_path)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (None, None)


def test_refusals(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "gemma3", head_dim=16)
    _edit_config(tmp_path, use_bidirectional_attention=True)
    with pytest.raises(ModelConfigError, match="use_bidirectional_attention is not supported"):
        load_model_config(tmp_path)
    _edit_config(tmp_path, use_bidirectional_attention=False, hidden_activation="relu")
    with pytest.raises(ModelConfigError, match="activation 'relu' is not supported for Gemma3ForCausalLM"):
        load_model_config(tmp_path)
    llama = tmp_path / "llama"
    save_tiny_model(llama, "llama")
    _edit_config(llama, hidden_act="gelu_pytorch_tanh")  # only Gemma implements GeGLU
    with pytest.raises(ModelConfigError, match="activation 'gelu_pytorch_tanh' is not supported for LlamaForCausalLM"):
        load_model_config(llama)


def test_model_refuses_a_backend_with_another_scale_or_softcap(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "gemma2", **FAMILIES["gemma2"])
    model = load_model(tmp_path, torch.float32, "cpu")
    cfg = model.config
    with pytest.raises(ValueError, match="needs an attention backend with scale"):
        model.backend = TorchNativeBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="needs an attention backend with scale"):
        model.backend = TorchNativeBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale)
    model.backend = TorchNativeBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale, 5.0)


def test_softcap_backend_choice() -> None:
    """Triton refuses soft-capping (it would attend without it); "auto" never picks it then."""
    gemma = Combination(
        "Gemma2ForCausalLM", FamilyCapabilities(), torch.device("cpu"), torch.float32, torch.float32, softcap=True
    )
    assert choose_backend("auto", gemma) in ("cpu", "torch")
    assert choose_backend("auto", replace(gemma, device=torch.device("cuda"))) == "torch"
    with pytest.raises(ValueError, match="'triton' cannot run .* attention logit soft-capping"):
        choose_backend("triton", gemma)
    backend = build_backend("torch", BackendShape(4, 2, 8, softcap=2.0), EngineConfig(device="cpu"))
    assert (backend.softcap, backend.scale) == (2.0, 8**-0.5)
    pytest.importorskip("triton")
    from tokenmill.attention.triton import TritonBackend
    from tokenmill.attention.triton.config import TritonConfig

    assert not TritonBackend.capabilities.softcap
    with pytest.raises(ValueError, match="triton attention backend does not implement attention logit soft-capping"):
        TritonBackend(4, 2, 8, TritonConfig(16, 16, 256, 4), "cpu", softcap=2.0)
