"""APIKeyCheck: an ASGI middleware that refuses requests without the API key before reading their body.

A request passes with ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (constant-time compare);
``/health`` and the web page's static files (``/`` and ``/web/...``: they hold no data) are always
open. Any other request is answered 401 in the route's error shape
(:func:`~tokenmill.server.http.errors.error_response`) from its headers alone: ``receive`` is never
called, so an unauthenticated client cannot make the server read or buffer a body, and the
connection is closed after the answer.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.http.errors import APIError, error_response

OPEN_PATHS = frozenset({"/health", "/", "/favicon.ico"})
OPEN_PREFIXES = ("/web/",)


class APIKeyCheck:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    def authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        offered = [headers.get("x-api-key", ""), token.strip() if scheme.lower() == "bearer" else ""]
        return any(key and hmac.compare_digest(key.encode(), self.expected) for key in offered)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        open_path = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if scope["type"] != "http" or open_path or self.authorized(Headers(scope=scope)):
            await self.app(scope, receive, send)
            return
        message = "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
        response = error_response(Request(scope), APIError(401, message, code="invalid_api_key"))
        response.headers["connection"] = "close"
        await response(scope, receive, send)
