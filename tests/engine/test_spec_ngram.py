"""Prompt lookup's proposals against a plain-Python reference of the rule (the latest earlier
occurrence of the longest matching n-gram, n from max down to min, and the tokens after it)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tokenmill.engine.spec_ngram import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences with a token after them, latest first
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 4), (2, 4), (3, 5), (2, 8)])
def test_proposals_equal_the_rule_written_plainly(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(min_n, max_n)
    proposed = 0
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        k = rng.randrange(1, 7)
        expected = reference(tokens, k, min_n, max_n)
        assert proposer.propose(SimpleNamespace(all_token_ids=tokens), k) == expected, (tokens, k)
        proposed += bool(expected)
    assert 50 < proposed < 400  # both proposals and none were checked
