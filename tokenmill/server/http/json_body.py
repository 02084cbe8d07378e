"""Replies rendered to JSON on a worker thread.

A generation reply can be megabytes (``n`` choices of many tokens, each with its top logprobs);
rendering it on the event loop would stall every other connection, ``/health`` included, for as
long. :func:`json_response` renders as Starlette's ``JSONResponse`` does (compact, UTF-8, no NaN)
in a thread and answers with the bytes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import Response


async def json_response(content: Any) -> Response:
    """``content`` as an ``application/json`` response, serialized off the event loop."""
    body = await asyncio.to_thread(_render, content)
    return Response(body, media_type="application/json")


def _render(content: Any) -> bytes:
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
