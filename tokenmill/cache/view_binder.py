"""ViewBinder: binds each step's layer-3 view over one rank's KV storage and request-to-token table.

Steady-state decode: when a decode step has the same rows as the previous decode step, each one
token longer, the previous view's tensors are advanced in place. That is exact whichever sequences
occupy the rows: a decode view is a function of the rows, their lengths and this step's slots
alone (it reads positions and slots through the live request-to-token table), so advancing it
gives what a rebuild would, even for a row recycled to a new sequence exactly one token longer
than its previous occupant's last step. Backend metadata is not the cache's: each backend plans
it from the view per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.cache.storage import KVStorage
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view
from tokenmill.cache.views import DecodeKVCache, PrefillKVCache


@dataclass
class ViewStats:
    """Decode views advanced in place vs built anew (for metrics and tests)."""

    steady_state_steps: int = 0
    rebuilt_decode_steps: int = 0


class ViewBinder:
    """Views over ``storage`` and ``table`` (``[max_rows, max_context_len]`` int32), one per forward."""

    def __init__(self, storage: KVStorage, table: torch.Tensor) -> None:
        self.storage = storage
        self.table = table
        self.stats = ViewStats()
        self._last_decode: tuple[list[int], list[int], DecodeKVCache] | None = None

    def prefill(
        self, rows: list[int], prefix_lens: list[int], extend_lens: list[int], out_cache_loc: torch.Tensor
    ) -> PrefillKVCache:
        """View for an extend step: request ``i`` in table row ``rows[i]`` computes positions
        ``prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1``, stored at ``out_cache_loc`` in batch order."""
        return make_prefill_view(self.storage, self.table, rows, prefix_lens, extend_lens, out_cache_loc)

    def decode(self, rows: list[int], seq_lens: list[int], out_cache_loc: torch.Tensor) -> DecodeKVCache:
        """View for a decode step (``seq_lens`` include this step's token); advances the previous
        decode view in place in the steady state. A view stays valid until the next call."""
        last = self._last_decode
        if last is not None and last[0] == rows and all(a + 1 == b for a, b in zip(last[1], seq_lens)):
            view = last[2]
            view.seq_lens.add_(1)
            view.out_cache_loc.copy_(out_cache_loc)
            view.max_seq_len += 1
            self.stats.steady_state_steps += 1
        else:
            view = make_decode_view(self.storage, self.table, rows, seq_lens, out_cache_loc)
            self.stats.rebuilt_decode_steps += 1
        self._last_decode = (rows, seq_lens, view)
        return view
