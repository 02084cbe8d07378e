"""Incremental detokenization of one sequence's output, with stop strings and streaming hold-back."""

from __future__ import annotations

from tokenmill.request import SamplingParams
from tokenmill.tokenizer import Tokenizer

# Prompt tokens decoded as left context for the first output tokens, so that tokenizers whose
# decoding depends on the neighbours (SentencePiece's leading space, byte-level merges) are right.
_CONTEXT_TOKENS = 5

# Tokens that may wait for text (a character split across tokens, skipped special tokens) before
# whatever they decode to is taken as is: a UTF-8 character spans at most 4 bytes, so more pending
# tokens mean text that never completes, and the decoded window stays bounded.
_MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time, in work bounded by the new text.

    Each ``add_token`` decodes only a small window: the tokens already turned into text last time
    (for context) and those after them; the difference is the new text. Text is appended only once
    it does not end in U+FFFD, so a character split across tokens appears whole when its last byte
    arrives (a character still incomplete when generation ends never appears). After
    ``_MAX_PENDING_TOKENS`` tokens without complete text, replacement characters are taken as text,
    and tokens without any text (skipped special tokens) are dropped from the window. ``text``
    only grows by appending, until a stop string truncates it for good.

    Stop strings: each one has a matcher that only reads the new text, so a step's work does not
    grow with the output. The match with the earliest start wins (the shorter one on a tie); the
    text then ends right before it (or right after it with ``include_stop_str_in_output``), later
    tokens are ignored, and ``stopped_by`` names it.

    Streaming: ``take_delta(finished=False)`` withholds the longest suffix of ``text`` that is a
    prefix of some stop string (shorter than the longest stop string), so it never returns text a
    later stop would remove; once stopped, or with ``finished=True``, everything left is returned.
    All deltas concatenated equal ``text``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._matchers = [StopStringMatcher(stop) for stop in params.stop_strings]
        self._include_stop = params.include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # the window: context, then pending tokens
        self._read = len(self._ids)  # ids[:read] were already turned into text; kept as context
        self._parts: list[str] = []  # the text, as appended (never joined while generating)
        self._length = 0  # characters in text
        self._sent = 0  # characters of text returned by take_delta
        self._stopped_by: str | None = None

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def stopped_by(self) -> str | None:
        return self._stopped_by

    def add_token(self, token_id: int) -> None:
        """Append one generated token; a no-op once a stop string has matched."""
        if self._stopped_by is not None:
            return
        self._ids.append(token_id)
        context = self._decode(self._ids[: self._read])
        extended = self._decode(self._ids)
        complete = len(extended) > len(context) and not extended.endswith("\ufffd")
        if not complete and len(self._ids) - self._read < _MAX_PENDING_TOKENS:
            return
        if len(extended) <= len(context):  # the pending tokens have no text: drop them, keep the context
            del self._ids[self._read :]
            return
        del self._ids[: self._read]  # the tokens just read become the next context
        self._read = len(self._ids)
        self._append(extended[len(context) :])

    def take_delta(self, finished: bool) -> str:
        """Text not returned before that is safe to stream; ``finished=True`` returns all of it."""
        end = self._length
        if not finished and self._stopped_by is None:
            end -= max((matcher.matched for matcher in self._matchers), default=0)
        if end <= self._sent:
            return ""
        delta = self._last_chars(self._length - self._sent)[: end - self._sent]
        self._sent = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _append(self, new: str) -> None:
        """Add ``new`` to the text and end the text at the first stop string it completes."""
        start_of_new = self._length
        self._parts.append(new)
        self._length += len(new)
        best: tuple[int, int, str] | None = None  # (start, length, stop string)
        for matcher in self._matchers:
            end = matcher.feed(new)
            if end is not None:
                stop = matcher.stop
                candidate = (start_of_new + end - len(stop), len(stop), stop)
                best = candidate if best is None or candidate[:2] < best[:2] else best
        if best is None:
            return
        start, length, stop = best
        self._truncate(start + length if self._include_stop else start)
        self._stopped_by = stop

    def _truncate(self, length: int) -> None:
        """End the text after ``length`` characters (a cut within the last, unsent, parts)."""
        excess = self._length - length
        while excess > 0:
            last = self._parts.pop()
            if len(last) > excess:
                self._parts.append(last[: len(last) - excess])
            excess -= len(last)
        self._length = length

    def _last_chars(self, count: int) -> str:
        """The last ``count`` characters of the text, joining only the parts that hold them."""
        pieces: list[str] = []
        covered = 0
        for part in reversed(self._parts):
            if covered >= count:
                break
            pieces.append(part)
            covered += len(part)
        tail = "".join(reversed(pieces))
        return tail[len(tail) - count :]


class StopStringMatcher:
    """Knuth-Morris-Pratt matcher of one stop string over text fed piece by piece.

    ``matched`` is the length of the longest suffix of the text fed so far that is a prefix of
    ``stop``; it equals ``len(stop)`` once the stop string has occurred (feeding stops there).
    Feeding ``k`` characters costs O(k) amortized, whatever was fed before.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        self._fallback = _prefix_function(stop)

    def feed(self, text: str) -> int | None:
        """Read ``text``; the index just past the stop string's first occurrence in it, else None."""
        stop, fallback, matched = self.stop, self._fallback, self.matched
        for i, char in enumerate(text):
            while matched and stop[matched] != char:
                matched = fallback[matched - 1]
            if stop[matched] == char:
                matched += 1
                if matched == len(stop):
                    self.matched = matched
                    return i + 1
        self.matched = matched
        return None


def _prefix_function(text: str) -> list[int]:
    """``result[i]``: length of the longest proper prefix of ``text[: i + 1]`` that is also its suffix."""
    result = [0] * len(text)
    k = 0
    for i in range(1, len(text)):
        while k and text[i] != text[k]:
            k = result[k - 1]
        if text[i] == text[k]:
            k += 1
        result[i] = k
    return result
