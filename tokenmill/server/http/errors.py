"""Errors as HTTP responses, in OpenAI's shape or, under ``/v1/messages``, Anthropic's.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``.
Anthropic: ``{"type": "error", "error": {"type", "message"}}``.

Engine refusals map to statuses in :func:`engine_errors`; anything unexpected becomes a 500 whose
message carries an id that is also in the server log, next to the traceback. A full waiting queue
is a 429 with ``Retry-After``, as OpenAI and Anthropic answer when they are overloaded: OpenAI's
``{"type": "requests", "code": "rate_limit_exceeded"}``, Anthropic's ``rate_limit_error``.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenmill.engine.engine import EngineDeadError, EngineOverloadedError
from tokenmill.request import ContextLengthError, ParameterError
from tokenmill.server.http.nesting import too_deep_message

logger = logging.getLogger("tokenmill.server")

ANTHROPIC_PREFIX = "/v1/messages"
OVERLOADED_RETRY_AFTER_S = 1
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error for the client: HTTP ``status``, a message, the offending parameter if any, and
    extra response ``headers``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def error_response(request: Request, error: APIError) -> JSONResponse:
    """``error`` in the wire format of the route that ``request`` addressed."""
    if request.url.path.startswith(ANTHROPIC_PREFIX):
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        body: dict = {"type": "error", "error": {"type": kind, "message": error.message}}
    else:
        kind = (
            "server_error"
            if error.status >= 500
            else "authentication_error"
            if error.status == 401
            else "requests"
            if error.status == 429
            else "invalid_request_error"
        )
        body = {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


@contextlib.contextmanager
def engine_errors(aliases: Mapping[str, str]) -> Iterator[None]:
    """Turn the engine's refusals into APIErrors.

    ValueError -> 400; a :class:`ParameterError` names its parameter, renamed through ``aliases``
    to the route's own name for it, in ``param`` and in the message (a :class:`ContextLengthError`
    with code ``context_length_exceeded``);
    EngineOverloadedError -> 429 with ``Retry-After``; EngineDeadError -> 503.
    """
    try:
        yield
    except ContextLengthError as exc:
        param = aliases.get(exc.param, exc.param)
        raise APIError(400, exc.message_for(aliases), param=param, code="context_length_exceeded") from exc
    except ParameterError as exc:
        raise APIError(400, exc.message_for(aliases), param=aliases.get(exc.param, exc.param)) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    except EngineOverloadedError as exc:
        retry = {"Retry-After": str(OVERLOADED_RETRY_AFTER_S)}
        raise APIError(
            429, f"the server is overloaded, retry later: {exc}", code="rate_limit_exceeded", headers=retry
        ) from exc
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from exc


def install_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    """Render every error the app can raise in the route's wire format."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return error_response(request, APIError(400, f"the request body is not valid JSON: {detail}"))
        loc = [str(part) for part in first["loc"] if part != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return error_response(request, APIError(400, f"{where}: {first['msg']}", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):  # FastAPI's json.loads of the body
            return error_response(request, APIError(400, too_deep_message("the request body")))
        if exc.status_code == 413:
            message = f"the request body is larger than the limit of {max_body_bytes} bytes"
            return error_response(request, APIError(413, message, code="request_too_large"))
        return error_response(request, APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        logger.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return error_response(request, APIError(500, f"internal server error (id {error_id})", code="internal_error"))
