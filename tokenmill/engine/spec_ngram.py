"""Prompt lookup: propose the tokens that followed the sequence's last n tokens where those n tokens
occurred before in its prompt or output (no model, no memory beyond the tokens)."""

from __future__ import annotations

import numpy as np

from tokenmill.engine.sequence import Sequence


class NgramProposer:
    """For ``n`` from ``max_n`` down to ``min_n``: the latest earlier occurrence of the last ``n``
    tokens; the tokens that followed it (up to ``k``, at least one) are the proposal. No occurrence of
    any length: no proposal."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``seq``'s tokens (empty: no guess)."""
        tokens = np.asarray(seq.all_token_ids, dtype=np.int64)
        # the earlier positions holding the last token (each with a token after it): where every
        # occurrence of the last n tokens ends, for any n
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            fits = ends[ends >= n - 1]
            windows = tokens[fits[:, None] - np.arange(n - 1, -1, -1)]  # the n tokens ending at each
            hits = fits[(windows == tokens[-n:]).all(axis=1)]
            if hits.size:
                start = int(hits[-1]) + 1
                return tokens[start : start + k].tolist()
        return []

    def retain(self, seq_ids: set[int]) -> None:
        """Nothing to forget: proposals come from the sequence's tokens alone."""
