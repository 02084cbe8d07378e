"""Tensor parallelism in the model layer: which part of each weight a rank holds, and the collectives
of its forward. At ``tp.size == 1`` nothing here is used: the blocks build their plain modules.

The layout (Megatron's): q/k/v and gate/up are column-parallel (each rank holds a contiguous block
of heads / of the intermediate width), o_proj and down_proj row-parallel (each rank multiplies its
block of input columns; one all-reduce sums the partial outputs, the bias is added once after it).
KV heads are split across ranks, or replicated when there are fewer KV heads than ranks (each rank
then holds the one KV head its query heads read). The embedding and the LM head are split over the
vocabulary (padded to a multiple of the ranks): the embedding sums the ranks' lookups with one
all-reduce; the LM head all-gathers the logits of the rows that need them only.

MoE experts are sharded, not distributed: every rank holds every expert's block of the expert
width (column-parallel gate/up, row-parallel down) and the router is replicated, so a MoE layer is
one all-reduce like a dense MLP, every rank does the same share of work whatever the routing (expert
parallelism leaves ranks idle when the tokens of a step go to a few experts, as small decode batches
do), and each rank loads a slice of every expert tensor like any other column/row-parallel weight.

The process group is built by ``tokenmill.distributed``; the model only receives a
:class:`TensorParallel` while it is built (:func:`building`), so the same process can build tp=1
models before or after.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.kernels.linear import Linear


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group (torch.distributed's default group)."""

    size: int = 1
    rank: int = 0

    def block(self, total: int, what: str) -> slice:
        """This rank's contiguous block of ``total`` items, which must divide evenly (ValueError naming ``what``)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def padded_block(self, total: int) -> tuple[int, slice]:
        """``(rows per rank, this rank's rows of 0..total-1)`` for ``total`` rows padded to a multiple of the ranks."""
        per_rank = -(-total // self.size)
        start = min(self.rank * per_rank, total)
        return per_rank, slice(start, min(start + per_rank, total))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, n]`` of every rank side by side: ``[rows, size * n]``, rank 0's columns first."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
_current: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("tensor_parallel", default=SINGLE)


def current() -> TensorParallel:
    """The tensor-parallel place of the model being built (:data:`SINGLE` outside :func:`building`)."""
    return _current.get()


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Modules constructed inside hold ``tp``'s shards."""
    token = _current.set(tp)
    try:
        yield
    finally:
        _current.reset(token)


def kv_head_block(tp: TensorParallel, n_heads: int, n_kv_heads: int) -> slice:
    """The KV heads this rank holds: its block when they split evenly, else (fewer KV heads than ranks,
    ``size`` a multiple of them) the one KV head its query heads read, replicated on several ranks."""
    if n_kv_heads >= tp.size:
        return tp.block(n_kv_heads, "num_key_value_heads")
    if tp.size % n_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp.size}) must divide or be a multiple of num_key_value_heads ({n_kv_heads})"
        )
    head = tp.block(n_heads, "num_attention_heads").start // (n_heads // n_kv_heads)
    return slice(head, head + 1)


def scaled(block: slice, factor: int) -> slice:
    """``block`` of items as rows of ``factor`` rows each (heads -> their rows of a projection)."""
    return slice(block.start * factor, block.stop * factor)


class CheckpointPart(NamedTuple):
    """This rank's part ``index`` of a checkpoint tensor of shape ``shape``."""

    shape: tuple[int, ...]
    index: tuple[slice, ...]


class CheckpointParts:
    """A module whose parameters hold parts of their checkpoint tensors (``checkpoint_parts``, by
    parameter name; a parameter not listed holds all of its tensor)."""

    checkpoint_parts: dict[str, CheckpointPart]


class RowParallelLinear(Linear, CheckpointParts):
    """``x @ W.T + b`` where this rank holds the input columns ``cols`` of ``W`` and gets the matching
    slice of ``x``: the partial products are summed by one all-reduce, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, cols: slice) -> None:
        super().__init__(cols.stop - cols.start, out_features, bias=bias)
        self.tp = tp
        self.checkpoint_parts = {"weight": CheckpointPart((out_features, in_features), (slice(None), cols))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.product(x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module, CheckpointParts):
    """An embedding of which this rank holds the rows ``vocab`` (of ``per_rank`` rows, the rest padding):
    tokens outside them look up zeros, and one all-reduce sums the ranks' lookups."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        per_rank, self.vocab = tp.padded_block(vocab_size)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden))
        self.tp = tp
        self.checkpoint_parts = {"weight": CheckpointPart((vocab_size, hidden), (self.vocab,))}

    @property
    def n_rows(self) -> int:
        """Rows of :attr:`weight` that hold checkpoint rows (the rest pad)."""
        return self.vocab.stop - self.vocab.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.n_rows)
        h = self.weight[local.masked_fill(outside, 0)]
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))


class VocabParallelLMHead(Linear, CheckpointParts):
    """The LM head's rows ``vocab`` of the vocabulary; :meth:`gather` joins the ranks' logits."""

    def __init__(self, hidden: int, vocab_size: int, tp: TensorParallel) -> None:
        per_rank, self.vocab = tp.padded_block(vocab_size)
        super().__init__(hidden, per_rank, bias=False)
        self.tp = tp
        self.checkpoint_parts = {"weight": CheckpointPart((vocab_size, hidden), (self.vocab,))}


def gather_logits(tp: TensorParallel, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's vocabulary block of ``logits`` joined, without the padding: ``[rows, vocab_size]``."""
    return tp.all_gather_columns(logits)[:, :vocab_size]


def checkpoint_part(module: nn.Module, leaf: str) -> CheckpointPart | None:
    """The part of its checkpoint tensor that ``module.<leaf>`` holds (None: all of it)."""
    return module.checkpoint_parts.get(leaf) if isinstance(module, CheckpointParts) else None


def param_rows(module: nn.Module) -> tuple[slice, ...]:
    """The rows of ``module``'s weight that checkpoint data fills (``()``: all; a vocab block leaves padding)."""
    if isinstance(module, VocabParallelEmbedding | VocabParallelLMHead):
        return (slice(0, module.vocab.stop - module.vocab.start),)
    return ()
