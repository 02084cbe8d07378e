"""The one check every embedding test makes against its oracle."""

from __future__ import annotations

import torch


def assert_embedding_close(embedding: list[float], expected: torch.Tensor) -> None:
    """``embedding`` equals ``expected`` (fp32): same shape, elementwise within 1e-4, cosine >= 0.99999."""
    got = torch.tensor(embedding)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) >= 0.99999
