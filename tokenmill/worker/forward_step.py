"""ForwardStep: one step's forward as plain data, the same on every rank.

Rank 0 makes it from the scheduler's plan; every rank's :class:`~tokenmill.worker.model_worker.ModelWorker`,
rank 0's included, executes it (tensor parallelism broadcasts it first). It holds no sequence,
request or cache object: token ids and positions, each request's table row and lengths, the new
tokens' slots, the rows that need logits, the rows whose final hidden states pooling requests
need, the slot copies of forked sequences, the LoRA adapter slot of each row (when any row has one),
an encoder's token type ids (when a request has a second segment),
and the request-to-token table entries written since the previous step (only for ranks whose table is a
replica; empty where the worker shares rank 0's table).

Batch order: request ``i`` owns query rows ``sum(extend_lens[:i]) ..`` where
``extend_lens[i] = seq_lens[i] - prefix_lens[i]``; a decode step has one row per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TableWrites:
    """Request-to-token table entries ``table[rows[j], positions[j]] = slots[j]``, in the order written."""

    rows: torch.Tensor  # [W] int64
    positions: torch.Tensor  # [W] int64
    slots: torch.Tensor  # [W] int64

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> TableWrites:
        none = torch.empty(0, dtype=torch.int64, device=device)
        return TableWrites(none, none, none)

    def __len__(self) -> int:
        return self.rows.numel()


@dataclass(frozen=True)
class ForwardStep:
    """Everything a rank needs to run one step's forward (tensors on the model's device)."""

    is_decode: bool
    """One query token per request, at position ``seq_lens[i] - 1`` (``prefix_lens[i] = seq_lens[i] - 1``)."""
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 slot where each new token's k/v are stored
    rows: list[int]  # [B] each request's row in the request-to-token table
    seq_lens: list[int]  # [B] KV length of each request after the step
    prefix_lens: list[int]  # [B] tokens already in the cache before the step
    logits_indices: torch.Tensor | None  # [L] int64 rows of the flat batch that need logits; None: every row
    fork_src: torch.Tensor  # [F] int64 slots whose k/v are copied after the forward ...
    fork_dst: torch.Tensor  # [F] int64 ... to these slots
    table_writes: TableWrites
    hidden_indices: torch.Tensor | None = None  # [H] int64 rows whose final-normed hidden states are returned
    lora_slots: torch.Tensor | None = None  # [T] int64 each row's LoRA adapter slot (-1: none); None: no row has one
    token_type_ids: torch.Tensor | None = None  # [T] int64 each row's segment (an encoder's text pairs); None: all 0

    @property
    def extend_lens(self) -> list[int]:
        return [n - p for n, p in zip(self.seq_lens, self.prefix_lens)]
