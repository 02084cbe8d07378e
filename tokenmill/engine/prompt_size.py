"""A lower bound on a text's token count from its UTF-8 length, known before tokenizing it.

Every token stands for at most ``bytes_per_token_bound(tokenizer)`` bytes of the text it was
encoded from, so a text of ``b`` bytes has at least ``ceil(b / bound)`` tokens. The bound is the
longest vocabulary entry in UTF-8 (entries spell their text at least as long as it is: byte-level
characters, ``▁`` for a space, ``<0x41>`` byte tokens), times what the normalizer can shrink text
by. Where part of the pipeline can swallow text of any length (whitespace-splitting
pre-tokenizers, unknown-token models that fuse or cover whole words, added tokens that strip
their neighbours' spaces, normalizers that delete), there is no bound and nothing is refused.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenmill.tokenizer import Tokenizer

# Unicode normalization and lowercasing shrink text at most 4x in UTF-8 (a 4-byte character such
# as U+1D400 becoming the 1-byte "A"); prepending only adds.
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
# Pre-tokenizers that split text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def bytes_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """Most UTF-8 bytes of input text one token can stand for; None when that is unbounded or
    unknown (slow tokenizers, and the pipelines named in the module docstring)."""
    if not tokenizer.hf.is_fast:
        return None
    backend = tokenizer.hf.backend_tokenizer
    if any(token.lstrip or token.rstrip for token in backend.get_added_tokens_decoder().values()):
        return None
    shrink = _normalizer_shrink(_state(backend.normalizer))
    if shrink is None or not _keeps_text(_state(backend.pre_tokenizer)) or not _model_covers_text(backend.model):
        return None
    longest = max(len(token.encode("utf-8", "surrogatepass")) for token in backend.get_vocab(with_added_tokens=True))
    return max(longest, 4) * shrink  # 4: an unknown token stands for one character


def min_tokens(text: str, bytes_per_token: int) -> int:
    """The fewest tokens ``text`` can encode to (special tokens added by the template aside)."""
    n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(n_bytes / bytes_per_token)


def _normalizer_shrink(node: dict[str, Any] | None) -> int | None:
    if node is None:
        return 1
    kind = node["type"]
    if kind == "Sequence":
        factors = [_normalizer_shrink(child) for child in node["normalizers"]]
        return None if None in factors else math.prod(factors)  # type: ignore[arg-type]
    if kind == "Replace" and "String" in node["pattern"] and node["content"]:
        pattern, content = node["pattern"]["String"].encode(), node["content"].encode()
        return max(1, math.ceil(len(pattern) / len(content)))
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_text(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    if node["type"] == "Sequence":
        return all(_keeps_text(child) for child in node["pretokenizers"])
    if node["type"] == "Split":
        return node.get("behavior") != "Removed"
    return node["type"] in _KEEPING_PRE_TOKENIZERS


def _state(component: Any) -> dict[str, Any] | None:
    """A ``tokenizers`` pipeline component (normalizer, pre-tokenizer) as its JSON, None for none."""
    return None if component is None else json.loads(component.__getstate__())


def _model_covers_text(model: Any) -> bool:
    """True when every token of ``model`` (a ``tokenizers`` model) covers a bounded piece of text (no
    fused or whole-word unknowns). A BPE model is read through its attributes (its JSON holds the
    whole vocabulary and merges: a second to write and parse at 128k tokens), a Unigram one through
    its JSON (the attributes lack ``unk_id``)."""
    kind = type(model).__name__
    if kind == "BPE":
        return model.byte_fallback or model.unk_token is None or not model.fuse_unk
    if kind == "Unigram":
        state = json.loads(model.__getstate__())
        return bool(state.get("byte_fallback")) or state.get("unk_id") is None
    return False
