"""Server-sent events: the wire format and a response that always releases its source."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse_event(data: Any, event: str | None = None) -> str:
    """One event; ``data`` is JSON-encoded unless it is already a string (e.g. ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that calls ``on_close`` when it ends, however it ends.

    When the client goes away mid-stream, Starlette cancels the streaming task; ``on_close`` then
    stops the work behind the events (e.g. aborts the engine requests).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
