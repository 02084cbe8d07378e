"""Message content as the one text a chat template receives: a string as is, or text parts joined by
newlines. Any other part (an image, a document, a tool result where none belongs) is a 400."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from tokenmill.server.http.errors import APIError


class Part(Protocol):
    """A content part or block: its ``type``, and its ``text`` when it is a text part."""

    type: str
    text: str | None


def joined_text(content: str | Sequence[Part] | None, text_types: Collection[str], param: str) -> str:
    """``content`` as one text (None as ""). Raises APIError(400) naming ``param`` for a part whose
    type is not one of ``text_types`` or that has no text."""
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in text_types or part.text is None:
            accepted = " and ".join(sorted(text_types))
            raise APIError(400, f"content parts of type {part.type!r} are not supported, only {accepted}", param=param)
    return "\n".join(part.text or "" for part in content)
