"""The browser page: ``GET /`` (the chat page) and ``GET /web/<file>`` (its script and style).

The files are static, inside the package (``static/``), and open without the API key (they hold no
data: the page asks for the key and sends it with every API call it makes). The page talks to the
server through its public routes only: ``/v1/models``, ``/v1/chat/completions`` (streamed) and
``/status``. ``tokenmill serve --no-web-ui`` leaves these routes out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
OPEN_PATHS = ("/", "/web/")
"""Paths (``/`` exactly, ``/web/`` as a prefix) served without the API key."""

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def static_files() -> StaticFiles:
    """The page's script and style, to mount at ``/web``."""
    return StaticFiles(directory=STATIC)
