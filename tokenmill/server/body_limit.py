"""BodySizeLimit: an ASGI middleware that refuses request bodies over a byte limit with 413.

The limit is enforced where the body is read: the wrapped ``receive`` raises
``HTTPException(413)`` at once when Content-Length announces too many bytes, and otherwise as soon
as the bytes received exceed the limit (a chunked body has no Content-Length). FastAPI re-raises
HTTPExceptions from body reading, so the app's own handler renders the 413 in the route's error
shape, and an over-long body is never buffered whole.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = Headers(scope=scope).get("content-length", "")
        too_long = announced.isdigit() and int(announced) > self.max_bytes
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            if too_long:
                raise HTTPException(413)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413)
            return message

        await self.app(scope, limited_receive, send)
