"""The engine's composition root: every part built once, each handed only what it needs.

:func:`prepare` runs on the caller's thread before the loop starts: it derives the settings' values
once (``EngineConfig.resolve``), checks the rule table with what the checkpoint is (one error naming
every conflict), and reads the tokenizer and pooling defaults. :func:`build` runs on the loop
thread, which then does every parallel torch op of the engine (libgomp, torch's OpenMP on Linux,
barely spin-waits once it manages more threads than CPUs; a second thread with its own OpenMP team,
such as the caller's after loading a model, would slow every step's many short parallel regions):
the executor (every rank's model worker), the KV cache and its tier, the scheduler, sampler,
speculator, LoRA adapters, output stage and intake.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.cache.fingerprint import checkpoint_fingerprint
from tokenmill.cache.kv_tier import KVTier
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.storage import ReqToTokenPool
from tokenmill.cache.tier_chain import open_kv_tier
from tokenmill.config import EngineConfig, Resolved
from tokenmill.config.rules import Checkpoint, check_rules
from tokenmill.cpu_memory import keep_freed_memory
from tokenmill.distributed.executor import Executor
from tokenmill.engine.grammar import GrammarCompiler
from tokenmill.engine.intake import Intake
from tokenmill.engine.lora_manager import LoRAManager
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.request_table import RequestTable
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.speculation import Speculator
from tokenmill.engine.step_core import StepCore
from tokenmill.engine.thread_governor import engine_thread_governor
from tokenmill.gguf_checkpoint import is_converted
from tokenmill.model.config import ModelConfig
from tokenmill.model.lora import read_adapter
from tokenmill.model.pooling_config import PoolingConfig, pooling_config, resolve_runner
from tokenmill.model.prequantized import checkpoint_format
from tokenmill.model.registry import resolve_config
from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineSetup:
    """What the caller's thread settles before the loop starts."""

    config: EngineConfig  # an encoder's without prefix caching (it has nothing to share)
    resolved: Resolved
    model_config: ModelConfig
    runner: str  # "generate" or "pooling"
    pooling: PoolingConfig | None  # the model's pooling defaults (runner "pooling")
    tokenizer: Tokenizer | None
    score_token_ids: tuple[int, int] | None
    eos_token_ids: set[int]


@dataclass
class EngineParts:
    """What the loop thread built; ``core`` runs the steps over them."""

    executor: Executor
    cache: CacheManager
    tier: KVTier | None  # the KV cache's host / disk tier (kv_cache_host_bytes, kv_cache_disk_dir)
    checkpoint_namespace: str  # the tier's namespace for the checkpoint's own weights
    speculator: Speculator | None
    lora: LoRAManager | None  # the LoRA adapters (enable_lora)
    scheduler: Scheduler
    requests: RequestTable
    output: OutputProcessor
    intake: Intake
    context_limit: int  # most tokens one sequence may hold: the context, capped by the KV cache
    core: StepCore


def prepare(config: EngineConfig) -> EngineSetup:
    """Derive, check and read what the engine needs before its loop builds the rest (ValueError naming
    every conflict of the settings with each other or with the checkpoint)."""
    resolved, mc = resolve_config(config)
    path = resolved.model_path
    is_prequantized = checkpoint_format(path) is not None  # also checks its quantization_config
    facts = Checkpoint(mc.encoder is not None, is_converted(path), is_prequantized, resolved.device.type)
    check_rules(config, facts)
    if mc.encoder is not None:
        config = config.replace(enable_prefix_caching=False)  # nothing to share
    runner = resolve_runner(config.runner, path, mc, config.classifier_from_token)
    pooling = (
        pooling_config(path, mc, config.classifier_from_token, config.score_template) if runner == "pooling" else None
    )
    tokenizer = None if config.skip_tokenizer_init else Tokenizer(config.tokenizer or path)
    score_token_ids = None if pooling is None else pooling.score_token_ids(tokenizer)
    eos = (tokenizer.eos_token_ids if tokenizer is not None else set()) | set(mc.eos_token_ids)
    return EngineSetup(config, resolved, mc, runner, pooling, tokenizer, score_token_ids, eos)


def build(setup: EngineSetup, weight_version: Callable[[], int]) -> EngineParts:
    """Every part of the engine, on the loop thread (``weight_version()`` tags each token)."""
    cfg, resolved, mc = setup.config, setup.resolved, setup.model_config
    device = resolved.device
    if device.type == "cpu" and cfg.cpu_keep_freed_memory:
        keep_freed_memory()
    threads = engine_thread_governor(cfg, device, threading.current_thread())
    req_pool = ReqToTokenPool(
        cfg.max_running_requests, resolved.max_context_len, device, journal=cfg.tensor_parallel_size > 1
    )
    executor = Executor.start(cfg, resolved, req_pool.table)
    namespace, tier = "", None
    try:
        storage = executor.worker.storage
        if cfg.cache.has_tier:
            namespace = _tier_namespace(cfg, resolved)
            tier = open_kv_tier(cfg.cache, storage, namespace)
        cache = CacheManager(cfg.cache, storage.n_slots, req_pool, tier)
        context_limit = min(resolved.max_context_len, cache.capacity_tokens)
        speculative = cfg.speculative()
        speculator = None
        if speculative is not None:
            speculator = Speculator.build(
                speculative, cfg, context_limit, cache.capacity_tokens, mc.vocab_size, setup.tokenizer, device
            )
        lora = None
        if cfg.enable_lora:
            lora = LoRAManager(
                cfg.max_loras, cfg.max_lora_rank, lambda slot, d: executor.call("load_lora_slot", slot, d)
            )
            for name, path in cfg.lora_adapters().items():
                lora.register(read_adapter(executor.worker.model, name, path, cfg.max_lora_rank))
        scheduler = Scheduler(cfg.scheduler, cache, speculator, lora)
        requests = RequestTable(scheduler)
        lora_version = lora.version if lora is not None else None
        output = OutputProcessor(requests, setup.eos_token_ids, weight_version, lora_version, setup.score_token_ids)
        intake = _intake(setup, context_limit)
        sampler = Sampler(mc.vocab_size, cfg.max_running_requests, device, cfg.seed)
        core = StepCore(executor, cache, scheduler, sampler, output, requests, speculator, threads, setup.eos_token_ids)
    except BaseException:  # nothing outlives a failed build: the other ranks stop, the tier's directory is unlocked
        try:
            if tier is not None:
                tier.close()
        finally:
            executor.shutdown()
        raise
    return EngineParts(
        executor, cache, tier, namespace, speculator, lora, scheduler, requests, output, intake, context_limit, core
    )


def _intake(setup: EngineSetup, context_limit: int) -> Intake:
    cfg, mc = setup.config, setup.model_config
    grammars = None
    if setup.tokenizer is not None and setup.pooling is None:
        timeout, cache_bytes = cfg.structured_output_compile_timeout, cfg.structured_output_cache_bytes
        grammars = GrammarCompiler(setup.tokenizer.hf, mc.vocab_size, setup.eos_token_ids, timeout, cache_bytes)
    return Intake(
        setup.tokenizer,
        cfg.limits.request_limits(mc.vocab_size),
        context_limit,
        setup.resolved.device,
        grammars,
        mc.hidden_size,
        setup.pooling,
        cfg.max_num_batched_tokens if mc.encoder is not None else None,
    )


def _tier_namespace(cfg: EngineConfig, resolved: Resolved) -> str:
    """The name of the KV this engine computes from its checkpoint's weights: the checkpoint,
    dtypes, quantization, page size (reads a few megabytes of the weight files)."""
    settings = (cfg.quantization, cfg.quantization_group_size, cfg.tensor_parallel_size, cfg.page_size)
    return checkpoint_fingerprint(resolved.model_path, str(resolved.dtype), str(resolved.kv_dtype), repr(settings))
