"""AsyncEngine: asyncio streams over an :class:`~tokenmill.engine.engine.Engine`.

``generate`` is an async iterator of output deltas. Intake (tokenization, validation) runs in a
worker thread, never on the event loop; tokenizer work runs on a pool of its own
(``EngineConfig.tokenizer_threads`` threads), so a flood of huge prompts waits there instead of
taking every thread of the loop's default executor. Tokenizer work that generates nothing (counting
tokens, detokenizing: :meth:`AsyncEngine.run_counting`) has a second pool of the same size, so it
never delays a generation's tokenization. If the consumer stops iterating early (e.g. the HTTP
client went away), the request is aborted and its KV freed at the next step boundary.

``pool`` runs one call's pooling requests (embeddings or scores): every prompt is validated (and
tokenized) before any is queued, so a bad one refuses the call with nothing allocated; it returns
each one's final output."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenmill.engine.engine import Engine
from tokenmill.engine.request_state import RequestState, new_request_id
from tokenmill.request import PoolingParams, RequestOutput, SamplingParams, ScorePair

T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        threads = engine.config.tokenizer_threads
        self._tokenizer_pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenmill-tokenize")
        self._counting_pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenmill-count")

    async def run_tokenizer(self, work: Callable[[], T]) -> T:
        """``work()`` (tokenizing for a generation) on the tokenizer pool: at most
        ``tokenizer_threads`` run at once, the rest wait their turn there."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work)

    async def run_counting(self, work: Callable[[], T]) -> T:
        """``work()`` (tokenizer work for a route that generates nothing: ``/tokenize``,
        ``count_tokens``) on a pool of its own, as :meth:`run_tokenizer` but never in its queue."""
        return await asyncio.get_running_loop().run_in_executor(self._counting_pool, work)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        call_id: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request (of the call ``call_id``, with the LoRA adapter ``lora_name``; see
        ``Engine.intake``) until its final one; refusals raise before the first delta."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(delta: RequestOutput) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        rid = request_id or new_request_id()
        finished = False
        gone = threading.Event()  # the consumer left; the submitting thread may not have finished

        def submit() -> None:
            self.engine.add_request(prompt, params, deliver, rid, call_id, lora_name)
            if gone.is_set():  # cancelled while we were submitting: abort after the add, in queue order
                self.engine.abort(rid)

        try:
            await (self.run_tokenizer(submit) if isinstance(prompt, str) else asyncio.to_thread(submit))
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                gone.set()
                self.engine.abort(rid)

    async def pool(
        self, prompts: list[str] | list[list[int]] | list[ScorePair], params: PoolingParams, call_id: str
    ) -> list[RequestOutput]:
        """The final output of each prompt's pooling request (ids ``call_id``, or ``call_id-i`` for
        several prompts), in prompt order. Refusals (ParameterError, EngineOverloadedError) raise
        before anything runs; if the caller is cancelled, the unfinished requests are aborted."""
        loop = asyncio.get_running_loop()
        results: list[asyncio.Future[RequestOutput]] = [loop.create_future() for _ in prompts]
        ids = [call_id] if len(prompts) == 1 else [f"{call_id}-{i}" for i in range(len(prompts))]

        def deliver(result: asyncio.Future[RequestOutput]) -> Callable[[RequestOutput], None]:
            def put(delta: RequestOutput) -> None:
                if delta.finished:
                    loop.call_soon_threadsafe(lambda: result.done() or result.set_result(delta))

            return put

        def intake() -> list[RequestState]:
            return [
                self.engine.intake(prompt, params, deliver(result), rid, call_id)
                for prompt, result, rid in zip(prompts, results, ids)
            ]

        states = await self.run_tokenizer(intake)
        submitted: list[str] = []
        try:
            for state in states:
                submitted.append(self.engine.submit(state))
            return list(await asyncio.gather(*results))
        finally:
            for rid, result in zip(submitted, results):
                if not result.done():
                    self.engine.abort(rid)
