"""Replies rendered to JSON on a worker thread, by orjson, a piece at a time.

A generation reply can be megabytes (``n`` choices of many tokens, each with its top logprobs).
Rendering holds the interpreter lock however it is threaded, so every other connection, ``/health``
included, waits for as long: :func:`json_response` renders in a thread with orjson (a tenth of the
standard library's time on such replies; docs/benchmarks.md's measurement), compact UTF-8 as Starlette's
``JSONResponse`` writes it, non-string keys as their strings (as ``json.dumps`` writes them). The
reply's top :data:`SPLIT_LEVELS` levels of containers are joined in Python around one orjson call
per member (a choice, an output item), so the lock is held by orjson for one member at a time
(~1 ms for a 530 KB choice), not for the whole reply (~20 ms for 8.5 MB): the event loop gets it in
between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from fastapi.responses import Response

T = TypeVar("T")
_REPLY_BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-reply")


async def build_off_loop(build: Callable[[], T]) -> T:
    """``build()`` run on the one reply-building thread: replies built at once take turns there
    rather than each taking a thread, so the event loop contends for the interpreter lock with one
    builder, not with as many as replies finish together."""
    return await asyncio.get_running_loop().run_in_executor(_REPLY_BUILDER, build)


async def json_response(content: Any) -> Response:
    """``content`` as an ``application/json`` response, serialized off the event loop."""
    body = await build_off_loop(lambda: render_json(content))
    return Response(body, media_type="application/json")


SPLIT_LEVELS = 2
"""Levels of containers rendered member by member (a reply dict, then its list of choices)."""


def render_json(content: Any, split_levels: int = SPLIT_LEVELS) -> bytes:
    """``content`` (dicts, lists, strings, numbers, booleans, None) as compact UTF-8 JSON; the top
    ``split_levels`` levels of lists and string-keyed dicts one member per orjson call."""
    if split_levels > 0 and isinstance(content, list):
        return b"[" + b",".join(render_json(item, split_levels - 1) for item in content) + b"]"
    if split_levels > 0 and isinstance(content, dict) and all(isinstance(key, str) for key in content):
        members = (orjson.dumps(key) + b":" + render_json(value, split_levels - 1) for key, value in content.items())
        return b"{" + b",".join(members) + b"}"
    return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
