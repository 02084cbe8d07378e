"""The browser page: ``GET /`` (the chat page), ``GET /web/<file>`` (its script, style and icon) and
``GET /favicon.ico`` (the icon).

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

router = APIRouter()


PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
"""The page's own script, style and API only; never in a frame (clickjacking); types as sent."""


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> FileResponse:
    """The page's icon where a browser asks for it by the old name (a page that names none, a JSON route)."""
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


def static_files() -> StaticFiles:
    """The page's script and style, to mount at ``/web``."""
    return StaticFiles(directory=STATIC)
