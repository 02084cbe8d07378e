"""Replies rendered to JSON on a worker thread, by orjson.

A generation reply can be megabytes (``n`` choices of many tokens, each with its top logprobs).
Rendering holds the interpreter lock however it is threaded, so every other connection, ``/health``
included, waits for as long: :func:`json_response` renders in a thread with orjson (a tenth of the
standard library's time on such replies; the README's measurement), compact UTF-8 as Starlette's
``JSONResponse`` writes it, non-string keys as their strings (as ``json.dumps`` writes them).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi.responses import Response


async def json_response(content: Any) -> Response:
    """``content`` as an ``application/json`` response, serialized off the event loop."""
    body = await asyncio.to_thread(render_json, content)
    return Response(body, media_type="application/json")


def render_json(content: Any) -> bytes:
    """``content`` (dicts, lists, strings, numbers, booleans, None) as compact UTF-8 JSON."""
    return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
