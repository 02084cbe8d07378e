"""BodyLimits: an ASGI middleware that bounds each request body in size (413) and in arrival time (408).

The limits are enforced where the body is read: the wrapped ``receive`` raises
``HTTPException(413)`` at once when Content-Length announces more than ``max_bytes``, and
otherwise as soon as the bytes received exceed it (a chunked body has no Content-Length); it
raises ``HTTPException(408)`` when the body is not complete ``timeout_s`` after the request's
headers. FastAPI re-raises HTTPExceptions from body reading, so the app's own handler renders
them in the route's error shape; an over-long body is never buffered whole. After either error
the response carries ``connection: close``: the rest of the body is never read.
Once the body is complete, ``receive`` is passed through untimed (it then waits for a disconnect).

Bodies still arriving hold at most ``max_arriving_bytes`` in all (slow senders, many at once,
would otherwise hold up to ``max_bytes`` each until their timeout): a chunk that would pass it gets
``HTTPException(503)`` with ``Retry-After``; a body's bytes stop counting once it is complete or
its request ends. The count lives on the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import time

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ARRIVING_RETRY_AFTER_S = 1


class BodyLimits:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, max_arriving_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_arriving_bytes = max_arriving_bytes
        self.arriving_bytes = 0  # of every body not yet complete

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = Headers(scope=scope).get("content-length", "")
        too_long = announced.isdigit() and int(announced) > self.max_bytes
        deadline = time.monotonic() + self.timeout_s
        received = 0
        counted = 0  # of ``received``, in ``self.arriving_bytes``
        body_complete = False
        refused = False

        async def limited_receive() -> Message:
            nonlocal received, counted, body_complete, refused
            if body_complete:
                return await receive()
            if too_long:
                refused = True
                raise HTTPException(413)
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                refused = True
                raise HTTPException(408, f"the request body did not arrive within {self.timeout_s:g} s") from None
            if message["type"] == "http.request":
                chunk = len(message.get("body", b""))
                received += chunk
                if received > self.max_bytes:
                    refused = True
                    raise HTTPException(413)
                if self.arriving_bytes + chunk > self.max_arriving_bytes:
                    refused = True
                    raise HTTPException(
                        503,
                        f"request bodies still arriving hold {self.max_arriving_bytes} bytes; retry later",
                        headers={"Retry-After": str(ARRIVING_RETRY_AFTER_S)},
                    )
                self.arriving_bytes += chunk
                counted += chunk
            body_complete = message["type"] != "http.request" or not message.get("more_body", False)
            if body_complete:
                self.arriving_bytes -= counted
                counted = 0
            return message

        async def closing_send(message: Message) -> None:
            if refused and message["type"] == "http.response.start":
                MutableHeaders(scope=message)["connection"] = "close"
            await send(message)

        try:
            await self.app(scope, limited_receive, closing_send)
        finally:
            self.arriving_bytes -= counted
