"""Engine: one loop thread (:class:`~tokenmill.engine.loop.EngineLoop`) owns the scheduler, the KV
cache bookkeeping, rank 0's model worker and the sampler.

Other threads talk to it only through its command queue (add, abort, calls such as weight
updates) and receive results through per-request callbacks. Commands are applied between steps,
so a weight update never meets a half-finished forward. A step is three calls in one direction:
schedule -> execute (the plan as a plain-data step, run by every rank's model worker, which picks
eager, C++ decode or CUDA graph) -> sample, then the output stage appends, applies stop rules and
emits. A failure inside a step fails that step's requests with an error (a sampling failure only
its own request's) and the loop goes on; if the loop itself dies, :meth:`Engine.is_healthy` says
so and every later call fails fast.

LoRA adapters (``enable_lora``): :meth:`Engine.load_lora`, :meth:`unload_lora` and
:meth:`update_lora` read and check an adapter on the calling thread, then change the registry
(``engine/lora_manager.py``) between steps; a request names its adapter at :meth:`intake`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import traceback
from dataclasses import asdict
from typing import Any

import torch

from tokenmill.cache.fingerprint import checkpoint_fingerprint
from tokenmill.cache.kv_tier import KVTier
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.storage import ReqToTokenPool
from tokenmill.cache.tier_chain import open_kv_tier
from tokenmill.config import EngineConfig
from tokenmill.cpu_memory import keep_freed_memory
from tokenmill.distributed.worker_group import WorkerGroup, WorkerGroupError, start_worker_group
from tokenmill.engine.commands import EngineDeadError
from tokenmill.engine.executor import StepExecutor
from tokenmill.engine.grammar import GrammarCompiler
from tokenmill.engine.intake import Intake
from tokenmill.engine.loop import EngineLoop
from tokenmill.engine.lora_manager import LoRAManager
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.overload import EngineOverloadedError
from tokenmill.engine.request_state import RequestState
from tokenmill.engine.request_table import RequestTable
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.speculation import Speculator
from tokenmill.engine.thread_governor import engine_thread_governor
from tokenmill.engine.verifier import verify
from tokenmill.engine.weight_update import WeightsSource, apply_update, next_version, stage_update
from tokenmill.gguf_checkpoint import is_converted
from tokenmill.model.lora import LoRAAdapter, LoRAError, check_adapter, read_adapter
from tokenmill.model.parallel import SINGLE
from tokenmill.model.pooling_config import PoolingConfig, pooling_config, resolve_runner
from tokenmill.model.prequantized import checkpoint_format
from tokenmill.model.registry import load_model_config
from tokenmill.request import FinishReason, OutputCallback, ParameterError, PoolingParams, SamplingParams, now
from tokenmill.tokenizer import Tokenizer
from tokenmill.worker.model_worker import build_model_worker, max_context_len

logger = logging.getLogger("tokenmill.engine")


class Engine(EngineLoop):
    """Continuous-batching engine over one model. Thread-safe public methods."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = cfg = config or EngineConfig.from_kwargs(**kwargs)
        path = cfg.model_path()
        self.device = cfg.resolved_device()
        self.model_config = mc = load_model_config(path)
        if checkpoint_format(path) is not None and cfg.quantization is not None:  # also checks its quantization_config
            raise ValueError(
                f"{path} is a pre-quantized checkpoint (quantization_config in config.json): it loads quantized "
                f"as published; leave quantization unset (got {cfg.quantization!r})"
            )
        if is_converted(path) and (
            cfg.quantization is not None or cfg.tensor_parallel_size > 1 or self.device.type != "cpu"
        ):
            raise ValueError(
                f"{cfg.model} is a GGUF file: it loads as stored (quantization unset), on the CPU, without "
                "tensor parallelism"
            )
        self.runner = resolve_runner(cfg.runner, path, mc, cfg.classifier_from_token)
        self.pooling: PoolingConfig | None = None  # the model's pooling defaults (runner "pooling")
        if self.runner == "pooling":
            self.pooling = pooling_config(path, mc, cfg.classifier_from_token, cfg.score_template)
        if mc.encoder is not None:
            _check_encoder_settings(cfg)
            self.config = cfg = dataclasses.replace(cfg, enable_prefix_caching=False)  # nothing to share
        self.dtype = cfg.resolved_dtype(mc.checkpoint_dtype)
        self.tokenizer = None if cfg.skip_tokenizer_init else Tokenizer(cfg.tokenizer or path)
        self.score_token_ids = None if self.pooling is None else self.pooling.score_token_ids(self.tokenizer)
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else set()
        self.eos_token_ids = tokenizer_eos | set(mc.eos_token_ids)
        self.step_time = 0.0  # wall seconds in steps that ran a forward
        self.forward_time = 0.0  # of which inside the model forward
        self.workers: WorkerGroup | None = None  # the other tensor-parallel ranks (tensor_parallel_size > 1)
        self.tier: KVTier | None = None  # the KV cache's host / disk tier (kv_cache_host_bytes, kv_cache_disk_dir)
        self._checkpoint_namespace = ""  # the tier's namespace for the checkpoint's own weights
        self.executor: StepExecutor | None = None
        self.lora: LoRAManager | None = None  # the LoRA adapters (enable_lora)
        super().__init__()
        self._start()

    def _build(self) -> None:
        """Model worker, KV cache, scheduler, sampler, intake: built on the loop thread, which then
        does every parallel torch op of the engine. (libgomp, torch's OpenMP on Linux, barely
        spin-waits once it manages more threads than CPUs; a second thread with its own OpenMP
        team, such as the caller's after loading a model, would slow every step's many short
        parallel regions; see the README.)"""
        cfg, mc = self.config, self.model_config
        if self.device.type == "cpu" and cfg.cpu_keep_freed_memory:
            keep_freed_memory()
        self.threads = engine_thread_governor(cfg, self.device, threading.current_thread())
        self.workers = start_worker_group(cfg, self.device)  # None at tensor_parallel_size 1
        tp = self.workers.tp if self.workers else SINGLE
        self.max_context_len = max_context_len(cfg, mc)
        req_pool = ReqToTokenPool(cfg.max_running_requests, self.max_context_len, self.device, journal=tp.size > 1)
        agree = self.workers.agree_on_slots if self.workers else None
        self.worker = build_model_worker(cfg, tp, self.device, req_pool.table, agree)
        self.model = self.worker.model
        if cfg.kv_cache_disk_dir is not None or cfg.kv_cache_host_bytes > 0:
            self._checkpoint_namespace = self._tier_namespace()
            self.tier = open_kv_tier(cfg, self.worker.storage, self._checkpoint_namespace)
        self.cache = CacheManager(cfg, self.worker.storage.n_slots, req_pool, self.tier)
        self.context_limit = min(self.max_context_len, self.cache.capacity_tokens)
        speculative = cfg.speculative()
        self.speculator = None
        if speculative is not None:
            self.speculator = Speculator.build(
                speculative,
                cfg,
                self.context_limit,
                self.cache.capacity_tokens,
                mc.vocab_size,
                self.tokenizer,
                self.device,
            )
        if self.worker.lora is not None:
            self.lora = LoRAManager(self.worker.lora, self.workers.load_lora_slot if self.workers else None)
            for name, path in cfg.lora_adapters().items():
                self.lora.register(read_adapter(self.model, name, path, cfg.max_lora_rank))
        self.scheduler = Scheduler(cfg, self.cache, self.speculator, self.lora)
        self.executor = StepExecutor(self.worker, self.cache, self.workers)
        self.sampler = Sampler(mc.vocab_size, cfg.max_running_requests, self.device, cfg.seed)
        self.weight_version = 0
        self.requests = RequestTable(self.scheduler)
        lora_version = self.lora.version if self.lora is not None else None
        self.output = OutputProcessor(
            self.requests, self.eos_token_ids, lambda: self.weight_version, lora_version, self.score_token_ids
        )
        grammars = None
        if self.tokenizer is not None and self.pooling is None:
            timeout, cache_bytes = cfg.structured_output_compile_timeout, cfg.structured_output_cache_bytes
            grammars = GrammarCompiler(self.tokenizer.hf, mc.vocab_size, self.eos_token_ids, timeout, cache_bytes)
        self._intake = Intake(
            self.tokenizer,
            cfg.request_limits(mc.vocab_size),
            self.context_limit,
            self.device,
            grammars,
            mc.hidden_size,
            self.pooling,
            cfg.max_num_batched_tokens if mc.encoder is not None else None,
        )

    # ------------------------------------------------------------------ public API
    def intake(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        callback: OutputCallback,
        request_id: str | None = None,
        call_id: str | None = None,
        lora_name: str | None = None,
    ) -> RequestState:
        """Validate a request into its state (tokenized once), ready for :meth:`submit`; generated
        with the LoRA adapter ``lora_name`` when given (one :meth:`load_lora` loaded). Requests
        sharing a ``call_id`` (the prompts of one API call) share admission as one call: waiting
        sequences are admitted call by call (``Scheduler``); None: a call of its own. With
        :class:`~tokenmill.request.PoolingParams` the request embeds its prompt instead: its final
        delta carries ``embedding``.

        Raises :class:`~tokenmill.request.ParameterError` (a ValueError naming the parameter) for
        bad input, EngineOverloadedError when every grammar-compile slot stays busy; nothing is
        allocated or queued.
        """
        if lora_name is not None:
            if self.lora is None:
                raise ParameterError("lora_request", "needs an engine started with enable_lora")
            if not self.lora.has(lora_name):
                known = ", ".join(repr(n) for n in self.lora.names()) or "none"
                raise ParameterError("lora_request", f"names no loaded adapter: {lora_name!r} (loaded: {known})")
            if isinstance(params, PoolingParams):
                raise ParameterError("lora_request", "is not supported for pooling (embedding) requests")
        state = self._intake.make(prompt, params, callback, request_id, call_id)
        state.lora_name = lora_name
        for seq in state.seqs:
            seq.lora_name = lora_name
        return state

    def check_text_fits(self, text: str, max_tokens: int | None = None) -> None:
        """Raise ParameterError ("prompt") for a text prompt too long for the context however it
        tokenizes, without tokenizing it (:meth:`intake` checks this too)."""
        self._intake.check_text_fits(text, max_tokens)

    def submit(self, state: RequestState) -> str:
        """Queue a validated request; ``state.callback`` receives its deltas on the engine thread.

        Raises EngineOverloadedError when the queue is full, EngineDeadError when the loop is
        gone, ValueError when the state was submitted before or its request id is in use.
        """
        self._check_alive()
        if not self.requests.reserve(state, self.config.max_waiting_requests):  # queued ones count too
            raise EngineOverloadedError(
                f"too many waiting requests (max_waiting_requests={self.config.max_waiting_requests})"
            )
        try:
            self._commands.put(lambda: self._admit(state), lambda: self._close_request(state))
        except EngineDeadError:
            self.requests.release(state)
            raise
        return state.request_id

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        callback: OutputCallback,
        request_id: str | None = None,
        call_id: str | None = None,
        lora_name: str | None = None,
    ) -> str:
        """:meth:`intake` then :meth:`submit`; returns the request id."""
        self._check_alive()
        return self.submit(self.intake(prompt, params, callback, request_id, call_id, lora_name))

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV is released at the next step boundary."""
        with contextlib.suppress(EngineDeadError):  # a stopped engine already ended every request
            self._commands.put(lambda: self.output.abort(request_id), lambda: None)

    def abort_all(self) -> int:
        """Abort every request the engine holds, between steps; returns how many were aborted."""
        return self.call(self._abort_all)

    def update_weights(
        self,
        weights: WeightsSource,
        *,
        version: int | None = None,
        flush_cache: bool = True,
        abort_running: bool = False,
    ) -> int:
        """Replace model weights between steps; returns the new weight version.

        ``weights``: ``(name, tensor)`` pairs with Hugging Face names (partial updates allowed)
        or a safetensors checkpoint folder. Every tensor is read, validated (finite values
        included) and staged on the calling thread first: an invalid update raises
        :class:`~tokenmill.model.loader.WeightError` (a bad ``version``: ParameterError) and
        leaves the engine exactly as it was. Between steps the version is checked again before
        anything changes; then the staged copy, the cache flush and the version bump happen
        together. With tensor parallelism the workers receive the validated tensors and stage their
        own parts between steps; if any rank refuses (WeightError naming it), no rank applies.
        In-flight requests keep running (each token is tagged with the version that
        produced it) unless ``abort_running``; ``flush_cache`` drops the prefix cache so no later
        request reuses KV computed under the old weights. ``version`` (an int below 2**63)
        defaults to current + 1 and must increase.
        """
        self._check_alive()
        next_version(self.weight_version, version)  # fail fast, before reading any weights
        staged = stage_update(self.model, weights, keep_whole=self.workers is not None)

        def apply() -> int:
            new_version = next_version(self.weight_version, version)
            if self.workers is not None:  # each worker stages its part; raises WeightError if any refuses
                self.workers.update_weights([(item.name, item.whole) for item in staged])
            apply_update(staged)  # at once: the workers have applied theirs (no step runs in between)
            if abort_running:
                self._abort_all()
            if flush_cache:
                self.cache.reset_prefix_cache()
            if self.tier is not None:  # a namespace no restart computes: these weights are in no file
                self.cache.rename_tier(f"{self._checkpoint_namespace}, weights {new_version} {secrets.token_hex(8)}")
            self.weight_version = new_version
            return new_version

        return self.call(apply)

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder ``path`` as adapter ``name`` (read and checked on the calling
        thread: :class:`~tokenmill.model.lora.LoRAError` for an adapter that does not fit; ValueError
        for a name in use); requests may name it once this returns."""
        manager = self._lora_manager()
        adapter = read_adapter(self.model, name, path, manager.max_rank)
        self.call(lambda: manager.register(adapter))

    def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` between steps, freeing its matrices. ValueError while a request that
        has not finished uses it; KeyError for an unknown name."""
        manager = self._lora_manager()

        def unload() -> None:
            users = sum(state.lora_name == name for state in self.requests.requests.values())
            if users:
                raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
            manager.unregister(name)

        self.call(unload)

    def update_lora(self, name: str, tensors: dict[str, torch.Tensor]) -> int:
        """Replace some or all of adapter ``name``'s matrices (PEFT tensor names, e.g.
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; the adapter's settings
        stay); returns its new version. Checked on the calling thread as a loaded adapter is
        (LoRAError, nothing changed), applied between steps at once: running requests go on with the
        new matrices, and prefixes cached under the old version are never matched again."""
        manager = self._lora_manager()
        entry = manager.adapter(name)
        if entry is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        old = entry.adapter
        merged = {f"{module}.lora_A.weight": d.a for module, d in old.deltas.items()}
        merged |= {f"{module}.lora_B.weight": d.b for module, d in old.deltas.items()}
        for key, tensor in tensors.items():
            short = key.removeprefix("base_model.model.")
            if short not in merged:
                raise LoRAError(f"LoRA adapter {name!r}: update names {key!r}, which the adapter does not hold")
            merged[short] = tensor
        adapter = check_adapter(self.model, name, old.settings, merged, manager.max_rank, f"update of {old.source}")
        return self.call(lambda: manager.update(adapter))

    def lora_adapters(self) -> dict[str, LoRAAdapter]:
        """The loaded adapters by name (empty without enable_lora)."""
        if self.lora is None:
            return {}
        return {name: entry.adapter for name in self.lora.names() if (entry := self.lora.adapter(name))}

    def _lora_manager(self) -> LoRAManager:
        self._check_alive()
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        return self.lora

    def _admit(self, state: RequestState) -> None:
        """Hand a submitted request to the scheduler (engine thread); one whose adapter was unloaded
        after its intake ends with an error instead."""
        if state.lora_name is not None and (self.lora is None or not self.lora.has(state.lora_name)):
            self.requests.requests[state.request_id] = state
            self.output.close(state, FinishReason.ERROR.value, f"LoRA adapter {state.lora_name!r} was unloaded")
            return
        self.requests.admit(state)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, on the device and in the host / disk tiers (between steps; running
        sequences keep their KV)."""
        self.call(self.cache.clear_tiers)

    def stats(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """A consistent snapshot of scheduler, cache and request counters (taken between steps;
        raises TimeoutError if no step boundary comes within ``timeout`` seconds)."""

        def snapshot() -> dict[str, Any]:
            graphs, table = self.worker.graphs, self.requests
            return {
                "scheduler": asdict(self.scheduler.stats),
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                **self.cache.snapshot(),
                "views": asdict(self.worker.views.stats),
                "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else 0,
                "cpu_thread_changes": self.threads.changes if self.threads is not None else 0,
                "weight_version": self.weight_version,
                "speculative": asdict(self.speculator.stats) if self.speculator is not None else None,
                "lora": self.lora.snapshot() if self.lora is not None else None,
                "step_time_s": self.step_time,
                "forward_time_s": self.forward_time,
                "cuda_graph_capture_s": sum(graphs.capture_seconds.values()) if graphs else 0.0,
                "finished_requests": table.finished_requests,
                "failed_requests": table.failed_requests,
                "active_requests": len(table.requests),
            }

        return self.call(snapshot, timeout)

    def _close_request(self, state: RequestState) -> None:
        """The final delta of a request the loop will not run: "abort" after a shutdown, "error" after a crash."""
        if self._crash is None:
            self.output.close(state, FinishReason.ABORT.value, None)
        else:
            self.output.close(state, FinishReason.ERROR.value, f"the engine loop died: {self._crash}")

    def _abort_all(self) -> int:
        request_ids = list(self.requests.requests)
        for request_id in request_ids:
            self.output.abort(request_id)
        return len(request_ids)

    # ------------------------------------------------------------------ engine thread
    def _has_work(self) -> bool:
        return self.scheduler.has_work()

    def _outside_failure(self) -> BaseException | None:
        failure = self.workers.failure if self.workers is not None else None
        return None if failure is None else WorkerGroupError(failure)

    def _answer_all(self) -> None:
        for state in list(self.requests.requests.values()):
            try:
                self._close_request(state)
            except Exception:
                logger.exception("ending request %s failed", state.request_id)

    def _release(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
        if self.tier is not None:
            if self.executor is not None:
                self.executor.move_tier_blocks()
            self.tier.close()

    def _before_idle(self) -> None:
        if self.threads is not None:
            self.threads.rest()
        if self.executor is not None:
            self.executor.move_tier_blocks()

    def _tier_namespace(self) -> str:
        """The name of the KV this engine computes from its checkpoint's weights: the checkpoint,
        dtypes, quantization, page size (reads a few megabytes of the weight files)."""
        cfg = self.config
        settings = (cfg.quantization, cfg.quantization_group_size, cfg.tensor_parallel_size, cfg.page_size)
        kv_dtype = cfg.resolved_kv_dtype(self.dtype)
        return checkpoint_fingerprint(cfg.model_path(), str(self.dtype), str(kv_dtype), repr(settings))

    def _step(self) -> None:
        if self.threads is not None:
            self.threads.tick()
        plan = self.scheduler.schedule()
        if plan is None:
            self._commands.drain(block=True)  # nothing runnable yet (e.g. n>1 siblings): wait, don't spin
            return
        started = now()
        self.requests.mark_scheduled(plan.seqs, started)
        output = self.output
        try:
            logits, verify_logits = self.executor.run(plan)
            sampled, result, failures = self.sampler.sample_isolating_failures(
                logits, plan.sample_seqs, self.eos_token_ids
            )
        except Exception as exc:
            logger.error("step failed; failing its %d sequence(s):\n%s", len(plan.seqs), traceback.format_exc())
            output.fail(plan.seqs, f"internal error in engine step: {type(exc).__name__}: {exc}")
            return
        for seq, exc in failures:  # only these sequences (and their siblings) fail; the others go on
            logger.error("sampling failed for sequence %d: %s: %s", seq.seq_id, type(exc).__name__, exc)
            output.fail([seq], f"internal error in sampling: {type(exc).__name__}: {exc}")
        output.process(sampled, result.token_ids, result.logprobs)
        output.finish_pooled(plan.pooled_seqs)
        if plan.verify:
            assert self.speculator is not None
            try:
                verify(
                    plan.verify,
                    verify_logits,
                    self.sampler,
                    output,
                    self.cache,
                    self.eos_token_ids,
                    self.speculator,
                )
            except Exception as exc:
                logger.error("verification failed:\n%s", traceback.format_exc())
                output.fail(
                    [v.seq for v in plan.verify], f"internal error in verification: {type(exc).__name__}: {exc}"
                )
        self.executor.move_tier_blocks()
        self.step_time += now() - started
        self.forward_time += self.worker.last_forward_time


def _check_encoder_settings(cfg: EngineConfig) -> None:
    """Refuse (ValueError) settings an encoder cannot run with, naming each."""
    refused = [
        name
        for name, on in (
            ("quantization", cfg.quantization is not None),
            ("tensor_parallel_size > 1", cfg.tensor_parallel_size > 1),
            ("enable_lora", cfg.enable_lora),
            ("speculative_config", cfg.speculative() is not None),
            ("kv_cache_disk_dir", cfg.kv_cache_disk_dir is not None),
            ("kv_cache_host_bytes", cfg.kv_cache_host_bytes > 0),
        )
        if on
    ]
    if refused:
        raise ValueError(f"an encoder model runs without {', '.join(refused)}")
