"""Engine: one loop thread owns the scheduler, the KV cache and the model.

Other threads talk to it only through a command queue (add, abort, calls such as weight updates)
and receive results through per-request callbacks. Commands are applied between steps, so a
weight update never meets a half-finished forward. A failure inside a step fails that step's
requests with an error and the loop goes on; if the loop itself dies, :meth:`Engine.is_healthy`
says so and every later call fails fast.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from collections.abc import AsyncIterator
from typing import Any, Callable, TypeVar

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.sizing import kv_cache_slots
from tokenmill.cache.storage import KVStorage, ReqToTokenPool
from tokenmill.config import EngineConfig
from tokenmill.engine.cuda_graphs import make_cuda_graph_runner
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.request import (
    CompletionOutput,
    FinishReason,
    OutputCallback,
    RequestMetrics,
    RequestOutput,
    INT63,
    SamplingParams,
    now,
)
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.sequence import Sequence, SeqStatus
from tokenmill.engine.weight_update import WeightsSource, apply_update, plan_update
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import load_model
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``; retry later."""


@dataclass(eq=False)
class RequestState:
    """Engine-side state of one request and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    callback: OutputCallback
    metrics: RequestMetrics
    token_limit: int  # prompt + max_tokens, as validated: no sequence grows past it
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)  # empty without a tokenizer
    emitted_tokens: list[int] = field(default_factory=list)  # per sequence: tokens already sent
    final_sent: list[bool] = field(default_factory=list)  # per sequence: its last delta was sent

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Engine:
    """Continuous-batching engine over one model. Thread-safe public methods."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config or EngineConfig.from_kwargs(**kwargs)
        cfg = self.config
        path = cfg.model_path()
        self.device = cfg.resolved_device()
        self.model_config = ModelConfig.from_pretrained(path)
        self.dtype = cfg.resolved_dtype(self.model_config.checkpoint_dtype)
        self.tokenizer = None if cfg.skip_tokenizer_init else Tokenizer(path)
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else set()
        self.eos_token_ids = tokenizer_eos | set(self.model_config.eos_token_ids)
        self.model = load_model(path, self.dtype, self.device)
        mc = self.model_config
        self.model.backend = self._make_backend()
        self.max_context_len = min(cfg.max_context_len or mc.max_context_len, mc.max_context_len)
        n_slots = kv_cache_slots(cfg, mc, self.dtype, self.device)
        storage = KVStorage(mc.num_layers, n_slots, mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        req_pool = ReqToTokenPool(cfg.max_running_requests, self.max_context_len, self.device)
        self.cache = CacheManager(cfg, storage, req_pool, mc.num_heads, mc.head_dim)
        self.scheduler = Scheduler(cfg, self.cache)
        self.runner = ModelRunner(self.model, self.cache, self.device, make_cuda_graph_runner(self.model, self.cache, cfg))
        self.sampler = Sampler(mc.vocab_size, cfg.max_running_requests, self.device, cfg.seed)
        self.weight_version = 0
        self.failed_requests = 0
        self.finished_requests = 0
        self.step_time = 0.0  # wall seconds in steps that ran a forward
        self.forward_time = 0.0  # of which inside the model forward
        self._requests: dict[str, RequestState] = {}
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._dead: str | None = None
        self._paused = False
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def _make_backend(self) -> AttentionBackend:
        """"auto": triton on CUDA when installed; for fp32 on CPU "cpu" (C++ kernels) when they
        build; else torch. An explicit choice is strict: it raises instead of falling back."""
        mc = self.model_config
        choice = self.config.attention_backend
        if choice == "auto":
            choice = self._auto_backend()
        if choice == "triton":
            from tokenmill.attention.triton import TritonBackend

            return TritonBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim, self.config)
        if choice == "cpu":
            from tokenmill.attention.cpu_backend import CpuBackend

            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise ValueError(f"attention_backend='cpu' needs fp32 on CPU, got {self.dtype} on {self.device}")
            return CpuBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim)
        return TorchNativeBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim)

    def _auto_backend(self) -> str:
        if self.device.type == "cuda":
            from tokenmill.attention.triton import TRITON_AVAILABLE

            return "triton" if TRITON_AVAILABLE else "torch"
        if self.device.type == "cpu" and self.dtype == torch.float32:
            from tokenmill.kernels.cpu import load_cpu_kernels

            return "cpu" if load_cpu_kernels() is not None else "torch"
        return "torch"

    # ------------------------------------------------------------------ public API
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        callback: OutputCallback,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; ``callback`` receives its output deltas (engine thread).

        Raises ValueError (naming the parameter) for bad input — nothing is allocated then —,
        EngineOverloadedError when the queue is full, EngineDeadError when the loop is gone.
        """
        self._check_alive()
        state = self._make_state(prompt, params, callback, request_id)
        self._queue(state)
        return state.request_id

    def validate(self, prompt: str | list[int], params: SamplingParams) -> None:
        """Raise ValueError if ``add_request`` would refuse this prompt and params."""
        self._make_state(prompt, params, lambda _: None, None)

    def _queue(self, state: RequestState) -> None:
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"too many waiting requests (max_waiting_requests={self.config.max_waiting_requests})"
            )
        self._commands.put(lambda: self._admit(state))

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV is released at the next step boundary."""
        if self.is_healthy():
            self._commands.put(lambda: self._abort(request_id))

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its error)."""
        self._check_alive()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the caller
                future.set_exception(exc)

        self._commands.put(run)
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
        or a safetensors checkpoint folder. Everything is validated first: an invalid update
        raises :class:`~tokenmill.model.loader.WeightError` and leaves the engine exactly as it
        was. In-flight requests keep running (each token is tagged with the version that
        produced it) unless ``abort_running``; ``flush_cache`` drops the prefix cache so no later
        request reuses KV computed under the old weights. ``version`` defaults to current + 1 and
        must increase.
        """
        self._check_alive()
        planned = plan_update(self.model, weights)

        def apply() -> int:
            new_version = self.weight_version + 1 if version is None else version
            if new_version <= self.weight_version:
                raise ValueError(f"version must increase: {new_version} <= current {self.weight_version}")
            if abort_running:
                for state in list(self._requests.values()):
                    self._abort(state.request_id)
            apply_update(self.model, planned)
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
            cache = self.cache
            return {
                "scheduler": asdict(self.scheduler.stats),
                "cache": asdict(cache.stats),
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_usage": cache.usage(),
                "kv_free_pages": cache.allocator.n_free,
                "kv_capacity_pages": cache.allocator.capacity,
                "kv_cached_pages": cache.radix.n_cached_pages if cache.radix is not None else 0,
                "free_rows": cache.req_pool.n_free,
                "weight_version": self.weight_version,
                "step_time_s": self.step_time,
                "forward_time_s": self.forward_time,
                "cuda_graph_capture_s": sum(self.runner.graphs.capture_seconds.values()) if self.runner.graphs else 0.0,
                "finished_requests": self.finished_requests,
                "failed_requests": self.failed_requests,
                "active_requests": len(self._requests),
            }

        return self.call(snapshot, timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ intake (caller thread)
    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(f"the engine loop is not running: {self._dead or 'stopped'}")

    def _make_state(
        self, prompt: str | list[int], params: SamplingParams, callback: OutputCallback, request_id: str | None
    ) -> RequestState:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        params.validate(vocab)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids: the engine runs without a tokenizer")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        limit = min(self.max_context_len, self.cache.capacity_tokens)
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, limit - len(ids))
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} exceeds the "
                f"context limit of {limit} tokens"
            )
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        if self.config.max_n and params.n > self.config.max_n:
            raise ValueError(f"n must be <= {self.config.max_n}, got {params.n}")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        state = RequestState(rid, text, ids, params, callback, RequestMetrics(arrival_time=now()), len(ids) + max_tokens)
        for i in range(params.n):
            seq = Sequence(prompt_token_ids=ids, params=params, index=i, group=state)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed((params.seed + 7919 * i) % INT63)
            if i > 0 and self.cache.radix is not None:
                seq.wait_for = state.seqs[0]
            state.seqs.append(seq)
            if self.tokenizer is not None:
                state.detokenizers.append(IncrementalDetokenizer(self.tokenizer, ids, params))
            state.emitted_tokens.append(0)
            state.final_sent.append(False)
        return state

    # ------------------------------------------------------------------ engine thread
    def _admit(self, state: RequestState) -> None:
        self._requests[state.request_id] = state
        for seq in state.seqs:
            self.scheduler.add(seq)

    def _abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT.value)
        self._emit(state)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.scheduler.has_work() or self._paused)
                if self.scheduler.has_work() and not self._paused:
                    self._step()
        except BaseException as exc:  # the loop itself failed: make it visible, fail everyone
            self._dead = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
            for state in list(self._requests.values()):
                self._fail(state.seqs, self._dead)
        finally:
            if self._dead is None:
                self._dead = "shut down"

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
        try:
            logits = self.runner.forward(plan)
            for seq, _ in plan.prefill:
                if seq.n_kv == seq.n_tokens:
                    self.cache.cache_prompt(seq)
            sample_seqs = plan.sample_seqs
            result = self.sampler.sample(logits, sample_seqs, self.eos_token_ids)
        except Exception as exc:
            logger.error("step failed; failing its %d sequence(s):\n%s", len(plan.seqs), traceback.format_exc())
            self._fail(plan.seqs, f"internal error in engine step: {type(exc).__name__}: {exc}")
            return
        touched: dict[str, RequestState] = {}
        for seq, token, logprobs in zip(sample_seqs, result.token_ids, result.logprobs):
            if seq.is_finished:  # a sibling's failure already ended it
                continue
            try:
                self._append(seq, token, logprobs)
                touched[seq.group.request_id] = seq.group
            except Exception as exc:  # e.g. detokenization: only this request fails
                logger.error("finishing a token failed:\n%s", traceback.format_exc())
                self._fail([seq], f"internal error after sampling: {type(exc).__name__}: {exc}")
        for state in touched.values():
            if state.request_id not in self._requests:
                continue
            try:
                self._emit(state)
            except Exception as exc:
                logger.error("emitting output failed:\n%s", traceback.format_exc())
                self._fail(state.seqs, f"internal error while emitting output: {type(exc).__name__}: {exc}")
        self.step_time += now() - started
        self.forward_time += self.runner.last_forward_time

    def _append(self, seq: Sequence, token: int, logprobs: Any) -> None:
        state: RequestState = seq.group
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now()
        seq.output_token_ids.append(token)
        seq.weight_versions.append(self.weight_version)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, FinishReason.STOP.value)
            return
        if params.stop_token_ids and token in params.stop_token_ids:
            self._finish(seq, FinishReason.STOP.value, stop_reason=token)
            return
        detok = state.detokenizers[seq.index] if state.detokenizers else None
        if detok is not None:
            detok.add_token(token)
        if detok is not None and detok.stopped_by is not None:
            self._finish(seq, FinishReason.STOP.value, stop_reason=detok.stopped_by)
        elif seq.n_tokens >= state.token_limit:  # max_tokens, or the context/KV limit when it is None
            self._finish(seq, FinishReason.LENGTH.value)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, cache: bool = True) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.remove(seq, cache_pages=cache)

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        """End ``seqs`` with an error (their KV is not cached) and notify their requests."""
        states: dict[str, RequestState] = {}
        for seq in seqs:
            if seq.is_finished:
                continue
            seq.error = message
            try:
                self._finish(seq, FinishReason.ERROR.value, cache=False)
            except Exception:  # never let cleanup of a failed step kill the loop
                logger.exception("cleanup of a failed sequence failed")
            states[seq.group.request_id] = seq.group
        for state in states.values():
            for seq in state.seqs:  # siblings of a failed sequence cannot complete the request either
                if not seq.is_finished:
                    seq.error = message
                    self._finish(seq, FinishReason.ERROR.value, cache=False)
            self._emit(state)

    @staticmethod
    def _text_delta(state: RequestState, seq: Sequence) -> str:
        """New text of ``seq``; none for a failed sequence (its detokenizer may be what failed)."""
        if not state.detokenizers or seq.error is not None:
            return ""
        return state.detokenizers[seq.index].take_delta(seq.is_finished)

    def _emit(self, state: RequestState) -> None:
        """Send the request's new tokens/text since the last emit; drop it once finished."""
        outputs = []
        for seq in state.seqs:
            if state.final_sent[seq.index]:
                continue
            start = state.emitted_tokens[seq.index]
            new_ids = seq.output_token_ids[start:]
            if not new_ids and not seq.is_finished:
                continue
            state.emitted_tokens[seq.index] = len(seq.output_token_ids)
            state.final_sent[seq.index] = seq.is_finished
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=self._text_delta(state, seq),
                    token_ids=new_ids,
                    logprobs=seq.output_logprobs[start:] if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    error=seq.error,
                    weight_versions=seq.weight_versions[start:],
                )
            )
        finished = state.finished
        if finished:
            state.metrics.finished_time = now()
            self._requests.pop(state.request_id, None)
            if any(s.finish_reason == FinishReason.ERROR.value for s in state.seqs):
                self.failed_requests += 1
            else:
                self.finished_requests += 1
        delta = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.seqs[0].n_cached_tokens,
        )
        try:
            state.callback(delta)
        except Exception:
            logger.exception("output callback of request %s failed", state.request_id)


class AsyncEngine:
    """asyncio front of an :class:`Engine`: ``generate`` is an async iterator of output deltas.

    Tokenization runs in a worker thread, never on the event loop. If the consumer stops
    iterating early (e.g. the HTTP client went away), the request is aborted and its KV freed at
    the next step boundary.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(Engine(config))

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(delta: RequestOutput) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        finished = False
        gone = threading.Event()  # the consumer left; the submitting thread may not have finished

        def submit() -> None:
            self.engine.add_request(prompt, params, deliver, rid)
            if gone.is_set():  # cancelled while we were submitting: abort after the add, in queue order
                self.engine.abort(rid)

        try:
            await asyncio.to_thread(submit)
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                gone.set()
                self.engine.abort(rid)
