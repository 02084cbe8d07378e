"""CPU parameters materialized in one huge-page mapping: one storage, module order, cache-line
aligned starts, no overlaps, tied weights once; values as in the checkpoint."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill.model.huge_pages import ALIGN_BYTES
from tokenmill.model.loader import load_model

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="needs Linux madvise(MADV_HUGEPAGE)")


@pytest.mark.parametrize("tied", [True, False])
def test_parameters_share_one_aligned_mapping(tmp_path: Path, tied: bool) -> None:
    hf = save_tiny_model(tmp_path, "llama", tie_word_embeddings=tied)
    model = load_model(tmp_path, torch.float32, "cpu")
    params = list(model.parameters())
    storage = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in params)
    starts = [p.data_ptr() for p in params]
    assert all(start % ALIGN_BYTES == 0 for start in starts)
    for p, following in zip(params, params[1:]):
        assert p.data_ptr() + p.numel() * p.element_size() <= following.data_ptr()
    assert (model.lm_head is None) == tied
    embed = hf.get_input_embeddings().weight
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(model.lm_head_weight, embed if tied else hf.get_output_embeddings().weight)
