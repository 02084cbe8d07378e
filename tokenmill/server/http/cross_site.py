"""CrossSiteGuard: requests a web page on another site makes a browser send are refused.

A server on 127.0.0.1 without an API key trusts whoever can reach it; a page on any site can make
the user's browser reach it too. Three checks, before any route runs:

- **Host** (DNS rebinding: an attacker's name resolved to 127.0.0.1): the ``Host`` header's name must
  be one of ``allowed_hosts`` where it names any. Else a server without an API key bound to a loopback
  address accepts only loopback names (``localhost``, ``127.0.0.1``, ``::1`` and the bound address);
  one with a key (every request then needs it, which another site's page does not have) or bound
  elsewhere (it cannot know the names it is reached by) accepts any. Refused: 400.
- **Origin** of a state-changing request (POST, PUT, PATCH, DELETE) to a server without an API key
  (with one, a request is as good as its key, which another site's page does not have): browsers
  send it on every cross-origin one, including those that need no CORS preflight (a form, ``fetch``
  in ``no-cors`` mode). It must be the server's own origin (the chat page) or one of
  ``allowed_origins`` (the CORS setting, ``"*"``: any). Clients that are not browsers send none.
  Refused: 403.
- **Content-Type** of a state-changing request: the types a form or a preflight-free ``fetch`` can
  send (``application/x-www-form-urlencoded``, ``multipart/form-data``, ``text/plain``) are refused
  with 415; every route takes JSON (or no body).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.http.errors import APIError, error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})


def default_allowed_hosts(bound_host: str, allowed: Iterable[str], keyless: bool) -> frozenset[str] | None:
    """The Host names a server bound to ``bound_host`` accepts: ``allowed`` when it names any, else
    the loopback names for a keyless server on a loopback address, else None (any)."""
    names = frozenset(name.lower() for name in allowed)
    if names:
        return names
    if keyless and _is_loopback(bound_host):
        return LOOPBACK_NAMES | {bound_host.lower().strip("[]")}
    return None


def host_name(host: str) -> str:
    """The name of a ``Host`` header (port and IPv6 brackets removed), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class CrossSiteGuard:
    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: frozenset[str] | None,
        allowed_origins: Iterable[str],
        check_origin: bool,
    ) -> None:
        """``check_origin``: refuse state-changing requests from other origins (a server without a key)."""
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = frozenset(origin.rstrip("/").lower() for origin in allowed_origins)
        self.check_origin = check_origin

    def refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.allowed_hosts is not None and host_name(host) not in self.allowed_hosts:
            return APIError(400, f"Host {host!r} is not one this server answers to (allowed_hosts)", param="host")
        if scope.get("method", "GET") not in UNSAFE_METHODS:
            return None
        origin = headers.get("origin")
        own = {f"{scheme}://{host.strip().lower()}" for scheme in ("http", "https")}
        if self.check_origin and origin is not None and "*" not in self.allowed_origins:
            normalized = origin.rstrip("/").lower()
            if normalized not in own and normalized not in self.allowed_origins:
                return APIError(403, f"a cross-site request from {origin!r} is refused (allowed_origins)")
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type in FORM_TYPES:
            return APIError(415, f"Content-Type must be application/json, got {media_type!r}", param="content-type")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        response = error_response(Request(scope), refusal)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _is_loopback(host: str) -> bool:
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
