"""TierMoves: the cache manager's traffic with the second tier of the KV cache (optional,
``cache/kv_tier.py``: host memory, disk, or host memory in front of disk).

Whole blocks of a prefix that enter the radix cache are queued to be saved, and an admission whose
device match ends where the tier holds the next blocks loads them instead of computing them (when
reading is measured faster than prefill). Nothing here touches KV data: :meth:`TierMoves.take`
hands the step (``cache/tier_mover.py``) the slots to save from (before any later forward can overwrite them)
and the blocks to store into freshly allocated slots (before the forward that reads them). Only
the base model's KV (namespace ``""``) computed in the manager's current epoch is saved. Engine
thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.cache.handle import KVHandle
from tokenmill.cache.kv_tier import KVTier, block_keys
from tokenmill.cache.storage import ReqToTokenPool


@dataclass(frozen=True)
class TierLoad:
    """Keys and values (and an int8 cache's scales) read from the second tier for ``slots`` of ``kv``
    (each part ``[n_layers, len(slots), ...]``, as ``KVStorage.read_slots`` returns them)."""

    kv: KVHandle
    position: int  # of slots[0] in kv's sequence
    slots: torch.Tensor
    parts: tuple[torch.Tensor, ...]


class TierMoves:
    """The saves and loads of ``tier`` queued since the step last took them, and the prefill speed
    that loading competes with; ``req_pool``: the rows that saves read their slots from. Without a
    tier nothing is saved and loading never pays."""

    def __init__(self, tier: KVTier | None, req_pool: ReqToTokenPool) -> None:
        self.tier = tier
        self.req_pool = req_pool
        self._saves: dict[str, torch.Tensor] = {}  # block name -> its slots, until take
        self._loads: list[TierLoad] = []
        self._prefill_seconds_per_token: float | None = None

    def take(self) -> tuple[list[tuple[str, torch.Tensor]], list[TierLoad]]:
        """``(saves, loads)`` queued since the last call: blocks to save (name, the slots holding them
        now) and blocks read for new slots. Saves must be read before loads are stored, both before
        the next forward."""
        saves, loads = list(self._saves.items()), self._loads
        self._saves, self._loads = {}, []
        return saves, loads

    def forget_saves(self) -> None:
        """Drop the saves not yet taken (their KV is no longer to be kept)."""
        self._saves.clear()

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        """A forward computed ``n_tokens`` prompt tokens in ``seconds``: the speed loading competes with."""
        if n_tokens < 16 or seconds <= 0:
            return
        per_token = seconds / n_tokens
        previous = self._prefill_seconds_per_token
        self._prefill_seconds_per_token = per_token if previous is None else 0.8 * previous + 0.2 * per_token

    def load_pays(self) -> bool:
        """Whether loading a token's KV from the tier is faster than computing it (True until both are measured)."""
        tier, per_token = self.tier, self._prefill_seconds_per_token
        if tier is None:
            return False
        read_bytes, read_seconds = tier.read_totals()
        if read_seconds <= 0 or per_token is None:
            return True
        return tier.payload_bytes / tier.block_tokens * read_seconds / read_bytes < per_token

    def load(
        self,
        kv: KVHandle,
        tokens: Sequence[int],
        epoch: int,
        extend: Callable[[KVHandle, int], torch.Tensor | None],
    ) -> None:
        """Extend ``kv`` (holding its device match of ``tokens``, in the manager's ``epoch``) through
        ``extend`` (the manager's) with the blocks the tier holds next, read now and queued to be
        stored; nothing when reading does not pay or pages lack."""
        tier = self.tier
        assert tier is not None and kv.row is not None
        bt, start = tier.block_tokens, kv.n_kv
        first = start // bt
        tier.record_query(len(tokens) - start)
        keys = self._block_keys(kv, tokens, epoch)[first:]
        held = 0
        while held < len(keys) and tier.contains(keys[held]):
            held += 1
        if not held or not self.load_pays():
            return
        blocks = []
        for key in keys[:held]:
            block = tier.load(key)
            if block is None:
                break
            blocks.append(block)
        n = (first + len(blocks)) * bt - start
        slots = extend(kv, n) if n > 0 else None
        if slots is None:
            return
        position, offset = start, start - first * bt
        for key, block in zip(keys, blocks):
            part = slots[position - start : position - start + bt - offset]
            self._loads.append(TierLoad(kv, position, part, tuple(p[:, offset:] for p in block)))
            tier.record_hit(key, part.numel())
            position += part.numel()
            offset = 0
        kv.n_cached_tokens = kv.n_kv

    def save(self, kv: KVHandle, tokens: Sequence[int], epoch: int) -> None:
        """Queue the whole blocks of ``tokens`` (computed in ``kv``'s row) that the tier lacks, if
        ``kv``'s KV is the base model's of the manager's ``epoch``."""
        if self.tier is None or kv.epoch != epoch or kv.namespace:
            return
        bt = self.tier.block_tokens
        for b, key in enumerate(self._block_keys(kv, tokens, epoch)):
            if key not in self._saves and not self.tier.contains(key):
                self._saves[key] = self.req_pool.table[kv.row, b * bt : (b + 1) * bt].long().cpu()

    def drop_loads(self, kv: KVHandle) -> int:
        """Forget ``kv``'s loads not yet stored; the first position they covered (a large number: none)."""
        mine = [load.position for load in self._loads if load.kv is kv]
        if mine:
            self._loads = [load for load in self._loads if load.kv is not kv]
        return min(mine, default=1 << 62)

    def _block_keys(self, kv: KVHandle, tokens: Sequence[int], epoch: int) -> list[str]:
        """The tier's names of the whole blocks of ``tokens`` (``kv``'s sequence's first tokens)."""
        assert self.tier is not None
        if kv.keys_epoch != epoch:
            kv.block_keys, kv.keys_epoch = [], epoch
        keys = block_keys(self.tier.namespace, tokens, self.tier.block_tokens, kv.block_keys)
        return keys[: len(tokens) // self.tier.block_tokens]
