"""AsyncEngine: asyncio streams over an :class:`~tokenmill.engine.engine.Engine`.

``generate`` is an async iterator of output deltas. Intake (tokenization, validation) runs in a
worker thread, never on the event loop. If the consumer stops iterating early (e.g. the HTTP
client went away), the request is aborted and its KV freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator

from tokenmill.engine.engine import Engine
from tokenmill.request import RequestOutput, SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request until its final one; refusals raise before the first delta."""
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
