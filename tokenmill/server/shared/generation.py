"""Generation: the engine requests behind one API call, one per prompt, as a single stream.

``Generation.start`` adds every request and waits for each one's first output, so that refusals
(bad input, overload, a dead engine) raise before any response byte is sent; if one prompt is
refused the others are aborted. Iterating a Generation yields ``(prompt index, delta)`` in
arrival order. ``close`` (synchronous, so it also works from a cancelled task) stops every
request that has not finished: its ``AsyncEngine.generate`` iterator is cancelled, and its
``finally`` aborts the request, whose KV is freed at the next engine step.

:func:`until_disconnected` runs a coroutine for a client that may leave, and cancels it when the
client does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request

from tokenmill.metrics import RequestTracker
from tokenmill.request import RequestOutput, SamplingParams, accumulate
from tokenmill.server.http.errors import APIError
from tokenmill.server.http.state import ServerState

T = TypeVar("T")
DISCONNECT_POLL_S = 0.1


class Generation:
    def __init__(
        self, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput], trackers: list[RequestTracker]
    ) -> None:
        self._queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()
        self._pumps = [
            asyncio.create_task(self._pump(i, stream, first, tracker))
            for i, (stream, first, tracker) in enumerate(zip(streams, firsts, trackers))
        ]

    @classmethod
    async def start(
        cls,
        state: ServerState,
        prompts: list[list[int]],
        params: list[SamplingParams],
        request_id: str,
        arrival: float,
        lora_name: str | None = None,
    ) -> Generation:
        """One engine request per prompt (``params[i]`` for ``prompts[i]``, with the LoRA adapter
        ``lora_name``: what the body's ``model`` named, see ``ServerState.check_model``); raises the
        first refusal.

        ``arrival`` (``time.monotonic()`` when the HTTP request came in) anchors the latency metrics.
        """
        streams = [
            state.async_engine.generate(
                prompt, p, request_id if len(prompts) == 1 else f"{request_id}-{i}", request_id, lora_name
            )
            for i, (prompt, p) in enumerate(zip(prompts, params))
        ]
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
            errors = [r for r in firsts if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:  # refused, or cancelled (the client left): abort the requests that started
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            raise
        trackers = [
            RequestTracker(state.metrics, arrival, len(first.prompt_token_ids), p.n) for first, p in zip(firsts, params)
        ]
        return cls(streams, firsts, trackers)

    async def _pump(
        self, index: int, stream: AsyncIterator[RequestOutput], first: RequestOutput, tracker: RequestTracker
    ) -> None:
        try:
            async with aclosing(stream):
                delta = first
                while True:
                    tracker.observe(delta)
                    self._queue.put_nowait((index, delta))
                    if delta.finished:
                        break
                    delta = await anext(stream)
        finally:
            tracker.close()
            self._queue.put_nowait((index, None))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        running = len(self._pumps)
        while running:
            index, delta = await self._queue.get()
            if delta is None:
                running -= 1
            else:
                yield index, delta
        await asyncio.gather(*self._pumps)  # re-raises a pump's unexpected failure

    async def collect(self) -> list[RequestOutput]:
        """The complete output of every prompt, in prompt order."""
        totals: list[RequestOutput | None] = [None] * len(self._pumps)
        async for index, delta in self:
            totals[index] = accumulate(totals[index], delta)
        return totals  # type: ignore[return-value]  # every prompt has at least its first delta

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise APIError(499)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "the client closed the connection")
    finally:
        task.cancel()
