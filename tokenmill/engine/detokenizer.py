"""Incremental detokenization of one sequence's output, with stop strings and streaming hold-back."""

from __future__ import annotations

from tokenmill.request import SamplingParams
from tokenmill.tokenizer import Tokenizer

# Prompt tokens decoded as left context for the first output tokens, so that tokenizers whose
# decoding depends on the neighbours (SentencePiece's leading space, byte-level merges) are right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time.

    Each ``add_token`` decodes only a small window: ``ids[prefix:read]`` (already emitted, for
    context) and ``ids[prefix:]``; the difference is the new text. Text is appended only once it
    does not end in U+FFFD, so a character split across tokens appears whole when its last byte
    arrives (a character still incomplete when generation ends never appears). ``text`` only grows
    by appending, until a stop string truncates it for good.

    Stop strings: after each append, only the region where a new match could lie is searched. The
    match with the earliest start wins (the shorter one on a tie); the text then ends right before
    it (or right after it with ``include_stop_str_in_output``), later tokens are ignored, and
    ``stopped_by`` names it.

    Streaming: ``take_delta(finished=False)`` withholds the longest suffix of ``text`` that is a
    prefix of some stop string, so it never returns text a later stop would remove; once stopped,
    or with ``finished=True``, everything left is returned. All deltas concatenated equal ``text``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # ids[prefix:read] were already turned into text; kept as context
        self._read = len(self._ids)
        self._text = ""
        self._sent = 0  # characters of text returned by take_delta
        self._stopped_by: str | None = None

    @property
    def text(self) -> str:
        return self._text

    @property
    def stopped_by(self) -> str | None:
        return self._stopped_by

    def add_token(self, token_id: int) -> None:
        """Append one generated token; a no-op once a stop string has matched."""
        if self._stopped_by is not None:
            return
        self._ids.append(token_id)
        context = self._decode(self._ids[self._prefix : self._read])
        extended = self._decode(self._ids[self._prefix :])
        if len(extended) <= len(context) or extended.endswith("\ufffd"):
            return
        old_len = len(self._text)
        self._text += extended[len(context) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._check_stop(old_len)

    def take_delta(self, finished: bool) -> str:
        """Text not returned before that is safe to stream; ``finished=True`` returns all of it."""
        end = len(self._text)
        if not finished and self._stopped_by is None:
            end -= self._held_back()
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _check_stop(self, old_len: int) -> None:
        """Look for stop strings ending after ``old_len`` (earlier ones were checked before)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        if best is None:
            return
        start, length, stop = best
        self._text = self._text[: start + length if self._include_stop else start]
        self._stopped_by = stop

    def _held_back(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for size in range(min(longest, len(self._text)), 0, -1):
            tail = self._text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
