"""Engine: the thread-safe facade of one model's engine: intake, submit, abort, stats, pause.

One loop thread (:class:`~tokenmill.engine.loop.EngineLoop`) owns every part the builder makes
(``engine/builder.py``): the executor (every rank's model worker), the KV cache bookkeeping, the
scheduler, sampler and output stage. Other threads talk to it only through its command queue (add,
abort, calls such as weight updates) and receive results through per-request callbacks. Commands
are applied between steps, so a weight update never meets a half-finished forward. A step is
``engine/step_core.py``'s schedule -> execute -> sample -> update; a failure inside a step fails
that step's requests with an error and the loop goes on; if the loop itself dies,
:meth:`Engine.is_healthy` says so and every later call fails fast. Weights, LoRA adapters and the
prefix cache are the admin room's (``engine/admin.py``). A new feature is a new room, not lines here.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.admin import EngineAdmin
from tokenmill.engine.builder import EngineParts, build, prepare
from tokenmill.engine.commands import EngineDeadError
from tokenmill.engine.loop import EngineLoop
from tokenmill.engine.overload import EngineOverloadedError
from tokenmill.engine.request_state import RequestState
from tokenmill.request import FinishReason, OutputCallback, ParameterError, PoolingParams, SamplingParams

logger = logging.getLogger("tokenmill.engine")


class Engine(EngineLoop, EngineAdmin):
    """Continuous-batching engine over one model. Thread-safe public methods."""

    parts: EngineParts | None  # type: ignore[assignment]  # None until the loop thread built them

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        setup = prepare(config or EngineConfig.from_kwargs(**kwargs))
        self.setup = setup
        self.config, self.model_config, self.device = setup.config, setup.model_config, setup.resolved.device
        self.dtype, self.max_context_len = setup.resolved.dtype, setup.resolved.max_context_len
        self.runner, self.pooling, self.tokenizer = setup.runner, setup.pooling, setup.tokenizer
        self.score_token_ids, self.eos_token_ids = setup.score_token_ids, setup.eos_token_ids
        self.parts = None
        self.weight_version = 0
        super().__init__()
        self._start()

    def _build(self) -> None:
        self.parts = parts = build(self.setup, lambda: self.weight_version)
        self.executor, self.worker, self.model = parts.executor, parts.executor.worker, parts.executor.worker.model
        self.cache, self.tier, self.scheduler, self.requests = parts.cache, parts.tier, parts.scheduler, parts.requests
        self.speculator, self.lora, self.output = parts.speculator, parts.lora, parts.output
        self.sampler, self.threads, self.context_limit = parts.core.sampler, parts.core.threads, parts.context_limit
        self._intake = parts.intake

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

    def stats(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """A consistent snapshot of scheduler, cache and request counters (taken between steps;
        raises TimeoutError if no step boundary comes within ``timeout`` seconds)."""

        def snapshot() -> dict[str, Any]:
            graphs, table, core = self.worker.graphs, self.requests, self.parts.core
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
                "step_time_s": core.step_time,
                "forward_time_s": core.forward_time,
                "cuda_graph_capture_s": sum(graphs.capture_seconds.values()) if graphs else 0.0,
                "finished_requests": table.finished_requests,
                "failed_requests": table.failed_requests,
                "active_requests": len(table.requests),
            }

        return self.call(snapshot, timeout)

    # ------------------------------------------------------------------ engine thread
    def _admit(self, state: RequestState) -> None:
        """Hand a submitted request to the scheduler; one whose adapter was unloaded after its intake
        ends with an error instead."""
        if state.lora_name is not None and (self.lora is None or not self.lora.has(state.lora_name)):
            self.requests.requests[state.request_id] = state
            self.output.close(state, FinishReason.ERROR.value, f"LoRA adapter {state.lora_name!r} was unloaded")
            return
        self.requests.admit(state)

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

    def _has_work(self) -> bool:
        return self.parts.core.has_work()

    def _step(self) -> None:
        if not self.parts.core.step():
            self._commands.drain(block=True)  # nothing runnable yet (e.g. n>1 siblings): wait, don't spin

    def _outside_failure(self) -> BaseException | None:
        return self.parts.executor.failure() if self.parts is not None else None

    def _answer_all(self) -> None:
        for state in list(self.requests.requests.values()):
            try:
                self._close_request(state)
            except Exception:
                logger.exception("ending request %s failed", state.request_id)

    def _release(self) -> None:
        if self.parts is None:  # the build failed: it released what it had started
            return
        self.parts.executor.shutdown()
        if self.parts.tier is not None:
            try:
                self.parts.core.move_tier_blocks()
            finally:
                self.parts.tier.close()

    def _before_idle(self) -> None:
        if self.threads is not None:
            self.threads.rest()
        self.parts.core.move_tier_blocks()
