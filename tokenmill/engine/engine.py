"""Engine: one loop thread owns the scheduler, the KV cache and the model.

Other threads talk to it only through a command queue (add, abort, calls such as weight updates)
and receive results through per-request callbacks. Commands are applied between steps, so a
weight update never meets a half-finished forward. A step is three calls in one direction:
schedule -> run (the runner picks eager, C++ decode or CUDA graph) -> sample, then the output
stage appends, applies stop rules and emits. A failure inside a step fails that step's requests
with an error (a sampling failure only its own request's) and the loop goes on; if the loop
itself dies, :meth:`Engine.is_healthy` says so and every later call fails fast. However the loop
ends (shutdown or death), every request and command it still holds is answered.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any, TypeVar

from tokenmill.cache.manager import CacheManager
from tokenmill.cache.sizing import kv_cache_slots
from tokenmill.cache.storage import KVStorage, ReqToTokenPool
from tokenmill.config import EngineConfig
from tokenmill.distributed.group import rank_device
from tokenmill.distributed.workers import WorkerGroup, WorkerGroupError
from tokenmill.engine.cuda_graphs import make_cuda_graph_runner
from tokenmill.engine.grammar import GrammarCompiler
from tokenmill.engine.intake import Intake, RequestState
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.overload import EngineOverloadedError
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import Sampler, prompt_logprobs
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.weight_update import WeightsSource, apply_update, next_version, stage_update
from tokenmill.model.loader import check_shardable, load_model
from tokenmill.model.parallel import SINGLE, TensorParallel
from tokenmill.model.registry import load_model_config
from tokenmill.request import FinishReason, OutputCallback, SamplingParams, now
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class Engine:
    """Continuous-batching engine over one model. Thread-safe public methods."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = cfg = config or EngineConfig.from_kwargs(**kwargs)
        path = cfg.model_path()
        self.device = cfg.resolved_device()
        self.model_config = mc = load_model_config(path)
        self.dtype = cfg.resolved_dtype(mc.checkpoint_dtype)
        self.tokenizer = None if cfg.skip_tokenizer_init else Tokenizer(path)
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else set()
        self.eos_token_ids = tokenizer_eos | set(mc.eos_token_ids)
        self.step_time = 0.0  # wall seconds in steps that ran a forward
        self.forward_time = 0.0  # of which inside the model forward
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._dead: str | None = None
        self._crash: str | None = None  # why the loop died, if it did (not set by a shutdown)
        self._closing = threading.Lock()  # orders every enqueue against the loop's final drain
        self._closed = False  # set under _closing when the loop ends: no command is queued after it
        self._paused = False
        self.workers: WorkerGroup | None = None  # the other tensor-parallel ranks (tensor_parallel_size > 1)
        built: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="tokenmill-engine", daemon=True)
        self._thread.start()
        built.result()  # the build's error, if any, raised here

    def _build(self) -> None:
        """Model, attention backend, KV cache, runner, sampler: built on the loop thread, which then
        does every parallel torch op of the engine. (libgomp, torch's OpenMP on Linux, barely
        spin-waits once it manages more threads than CPUs; a second thread with its own OpenMP
        team, such as the caller's after loading a model, would slow every step's many short
        parallel regions; see the README.)"""
        cfg, mc, path = self.config, self.model_config, self.config.model_path()
        if cfg.tensor_parallel_size > 1:
            check_shardable(path, TensorParallel(cfg.tensor_parallel_size))  # before any worker starts
            self.workers = WorkerGroup(cfg, rank_device(self.device, 0), cfg.distributed_timeout_s)
        self.model = load_model(path, self.dtype, self.device, self.workers.tp if self.workers else SINGLE)
        self.model.backend = self.model.make_backend(cfg, self.dtype)
        dtype = str(self.dtype).removeprefix("torch.") + (" (auto)" if cfg.dtype == "auto" else "")
        logger.info("%s on %s in %s, attention %s", mc.architecture, self.device, dtype, self.model.backend.name)
        self.max_context_len = min(cfg.max_context_len or mc.max_context_len, mc.max_context_len)
        kv_dtype = cfg.resolved_kv_dtype(self.dtype)
        n_kv_heads = self.model.local_heads()[1]  # this rank's share (all of them at tp=1)
        n_slots = kv_cache_slots(cfg, mc.num_layers, n_kv_heads, mc.head_dim, kv_dtype, self.device)
        n_slots = self.workers.agree_on_slots(n_slots) if self.workers else n_slots
        storage = KVStorage(mc.num_layers, n_slots, n_kv_heads, mc.head_dim, kv_dtype, self.device)
        req_pool = ReqToTokenPool(cfg.max_running_requests, self.max_context_len, self.device)
        self.cache = CacheManager(cfg, storage, req_pool)
        self.scheduler = Scheduler(cfg, self.cache)
        graphs = None if self.workers else make_cuda_graph_runner(self.model, self.cache, cfg)
        self.runner = ModelRunner(self.model, self.cache, self.device, graphs, self.workers)
        self.sampler = Sampler(mc.vocab_size, cfg.max_running_requests, self.device, cfg.seed)
        self.weight_version = 0
        self.output = OutputProcessor(self.scheduler, self.eos_token_ids, lambda: self.weight_version)
        self.context_limit = min(self.max_context_len, self.cache.capacity_tokens)
        grammars = None
        if self.tokenizer is not None:
            grammars = GrammarCompiler(
                self.tokenizer.hf,
                mc.vocab_size,
                self.eos_token_ids,
                cfg.structured_output_compile_timeout,
                cfg.structured_output_cache_bytes,
            )
        self._intake = Intake(
            self.tokenizer,
            cfg.request_limits(mc.vocab_size),
            self.context_limit,
            self.device,
            grammars,
        )

    # ------------------------------------------------------------------ public API
    def is_healthy(self) -> bool:
        workers_ok = self.workers is None or self.workers.failure is None
        return self._dead is None and self._thread.is_alive() and workers_ok

    def intake(
        self, prompt: str | list[int], params: SamplingParams, callback: OutputCallback, request_id: str | None = None
    ) -> RequestState:
        """Validate a request into its state (tokenized once), ready for :meth:`submit`.

        Raises :class:`~tokenmill.request.ParameterError` (a ValueError naming the parameter) for
        bad input, EngineOverloadedError when every grammar-compile slot stays busy; nothing is
        allocated or queued.
        """
        return self._intake.make(prompt, params, callback, request_id)

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
        if not self.output.reserve(state, self.config.max_waiting_requests):  # queued ones count too
            raise EngineOverloadedError(
                f"too many waiting requests (max_waiting_requests={self.config.max_waiting_requests})"
            )
        try:
            self._enqueue(lambda: self.output.admit(state), lambda: self._close_request(state))
        except EngineDeadError:
            self.output.stop_waiting(state)
            self.output.release(state.request_id)
            raise
        return state.request_id

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, callback: OutputCallback, request_id: str | None = None
    ) -> str:
        """:meth:`intake` then :meth:`submit`; returns the request id."""
        self._check_alive()
        return self.submit(self.intake(prompt, params, callback, request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV is released at the next step boundary."""
        with contextlib.suppress(EngineDeadError):  # a stopped engine already ended every request
            self._enqueue(lambda: self.output.abort(request_id), lambda: None)

    def abort_all(self) -> int:
        """Abort every request the engine holds, between steps; returns how many were aborted."""
        return self.call(self._abort_all)

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its error)."""
        self._check_alive()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the caller
                future.set_exception(exc)

        self._enqueue(run, lambda: future.set_exception(EngineDeadError(self._dead_message())))
        return future.result(timeout)

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
            self.weight_version = new_version
            return new_version

        return self.call(apply)

    def pause_generation(self) -> None:
        """Stop scheduling steps (requests stay queued/running) until :meth:`resume_generation`."""
        self.call(lambda: setattr(self, "_paused", True))

    def resume_generation(self) -> None:
        self.call(lambda: setattr(self, "_paused", False))

    @property
    def paused(self) -> bool:
        return self._paused

    def stats(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """A consistent snapshot of scheduler, cache and request counters (taken between steps;
        raises TimeoutError if no step boundary comes within ``timeout`` seconds)."""

        def snapshot() -> dict[str, Any]:
            cache, graphs = self.cache, self.runner.graphs
            live_usage, prefix_cache_usage = cache.usage()
            return {
                "scheduler": asdict(self.scheduler.stats),
                "cache": asdict(cache.stats),
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_usage": live_usage,  # pages of live sequences
                "kv_prefix_cache_usage": prefix_cache_usage,  # pages only the prefix cache holds
                "kv_free_pages": cache.allocator.n_free,
                "kv_capacity_pages": cache.allocator.capacity,
                "kv_cached_pages": cache.radix.n_cached_pages if cache.radix is not None else 0,
                "free_rows": cache.req_pool.n_free,
                "weight_version": self.weight_version,
                "step_time_s": self.step_time,
                "forward_time_s": self.forward_time,
                "cuda_graph_capture_s": sum(graphs.capture_seconds.values()) if graphs else 0.0,
                "finished_requests": self.output.finished_requests,
                "failed_requests": self.output.failed_requests,
                "active_requests": len(self.output.requests),
            }

        return self.call(snapshot, timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step and wait up to ``timeout`` seconds for it. Every request
        still held ends with "abort", queued calls raise EngineDeadError, and later ones raise it too."""
        self._stop.set()
        self._commands.put(lambda: None)  # wakes a waiting loop
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(self._dead_message())

    def _dead_message(self) -> str:
        return f"the engine loop is not running: {self._dead or 'stopped'}"

    def _enqueue(self, run: Callable[[], None], cancel: Callable[[], None]) -> None:
        """Queue ``run`` for the loop thread, or raise EngineDeadError once the loop has ended.
        A command still queued when the loop ends runs ``cancel`` instead (in the final drain), so
        every command is answered."""
        with self._closing:
            if self._closed:
                raise EngineDeadError(self._dead_message())
            self._commands.put(lambda: cancel() if self._closed else run())

    def _close_request(self, state: RequestState) -> None:
        """The final delta of a request the loop will not run: "abort" after a shutdown, "error" after a crash."""
        if self._crash is None:
            self.output.close(state, FinishReason.ABORT.value, None)
        else:
            self.output.close(state, FinishReason.ERROR.value, f"the engine loop died: {self._crash}")

    def _abort_all(self) -> int:
        request_ids = list(self.output.requests)
        for request_id in request_ids:
            self.output.abort(request_id)
        return len(request_ids)

    def _run(self, built: Future[None]) -> None:
        try:
            self._build()
        except BaseException as exc:
            self._dead = f"engine build failed: {type(exc).__name__}: {exc}"
            if self.workers is not None:
                self.workers.shutdown()
            built.set_exception(exc)
            return
        built.set_result(None)
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.workers is not None and self.workers.failure is not None:
                    raise WorkerGroupError(self.workers.failure)
                self._drain_commands(block=not self.scheduler.has_work() or self._paused)
                if self.scheduler.has_work() and not self._paused:
                    self._step()
        except BaseException as exc:  # the loop itself failed: make it visible, fail everyone
            self._dead = self._crash = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
        finally:
            if self._dead is None:
                self._dead = "shut down"
            self._close()
            if self.workers is not None:
                self.workers.shutdown()

    def _close(self) -> None:
        """Answer everyone still waiting on the ended loop: later enqueues raise, queued commands are
        cancelled, and every request held gets its final delta."""
        with self._closing:
            self._closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            try:
                command()
            except Exception:
                logger.exception("cancelling a queued command failed")
        for state in list(self.output.requests.values()):
            try:
                self._close_request(state)
            except Exception:
                logger.exception("ending request %s failed", state.request_id)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if plan is None:
            self._drain_commands(block=True)  # nothing runnable yet (e.g. n>1 siblings): wait, don't spin
            return
        started = now()
        for seq in plan.seqs:
            metrics = seq.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = started
                self.output.stop_waiting(seq.group)
        output = self.output
        try:
            logits = self.runner.forward(plan)
            sample_seqs = plan.sample_seqs
            for seq in sample_seqs[len(plan.decode) :]:  # computed prompts, each parent before its forked children
                self.cache.cache_prompt(seq.kv, seq.all_token_ids)
            n_sample = len(sample_seqs)
            spans = plan.prompt_logprobs
            for (seq, _), entries in zip(spans, prompt_logprobs(logits[n_sample:], spans)):
                seq.prompt_logprobs.extend(entries)
            sampled, result, failures = self.sampler.sample_isolating_failures(
                logits[:n_sample], sample_seqs, self.eos_token_ids
            )
        except Exception as exc:
            logger.error("step failed; failing its %d sequence(s):\n%s", len(plan.seqs), traceback.format_exc())
            output.fail(plan.seqs, f"internal error in engine step: {type(exc).__name__}: {exc}")
            return
        for seq, exc in failures:  # only these sequences (and their siblings) fail; the others go on
            logger.error("sampling failed for sequence %d: %s: %s", seq.seq_id, type(exc).__name__, exc)
            output.fail([seq], f"internal error in sampling: {type(exc).__name__}: {exc}")
        output.process(sampled, result.token_ids, result.logprobs)
        self.step_time += now() - started
        self.forward_time += self.runner.last_forward_time
