"""Mixture-of-experts MLP blocks: a softmax top-k router over stacked SwiGLU experts.

:class:`SparseMoE` computes, for tokens ``x`` ``[T, hidden]``, ``sum_k w[t, k] * expert_{i[t, k]}(x[t])``
with ``(w, i)`` the top-k of ``softmax(router(x))`` (in fp32; renormalized to sum 1 when the config
says so), as transformers' Mixtral and Qwen3-MoE blocks do. The computation is batched by expert:
the ``T * top_k`` (token, expert) pairs are sorted by expert, each expert that received tokens runs
one gate/up product, the fused SwiGLU and one down product over all of its tokens (through a
blocked oneDNN copy of the expert's weights where the CPU's dtype uses one, as ``Linear`` does),
and the weighted results are summed back per token with one ``index_add_``; no step loops over
tokens.

The experts' weights are stacked (``gate_up_proj`` ``[E, 2I, hidden]``, gate rows first;
``down_proj`` ``[E, hidden, I]``) and load from per-expert checkpoint tensors, whose names the
family gives (:class:`ExpertNames`) and :meth:`Experts.checkpoint_shards` lists. Unstacking them
(:meth:`Experts.unstack_`) replaces the stacks by one ``Linear`` per expert projection, each of which
may then be quantized on its own: :meth:`Experts.quantize_` quantizes them all, the GGUF loader
keeps those stored in a quantized type quantized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from tokenmill.kernels.fused import silu_and_mul
from tokenmill.kernels.linear import BlockedCopy, Linear, blocked_linear
from tokenmill.kernels.quant_format import QuantScheme
from tokenmill.model import parallel
from tokenmill.model.config import ModelConfigError, MoEConfig

CheckpointShard = tuple[str, nn.Parameter, tuple[int | slice, ...], parallel.CheckpointPart | None]
"""``(name relative to the module, parameter, index into it, the part of the checkpoint tensor it
holds)``; the part is None where it holds all of it."""


class CheckpointShards(ABC):
    """A module whose parameters load from checkpoint tensors it lists itself."""

    @abstractmethod
    def checkpoint_shards(self) -> list[CheckpointShard]:
        """A :data:`CheckpointShard` for each checkpoint tensor."""


class ExpertNames(NamedTuple):
    """Checkpoint names of one expert's projections under ``experts.<e>.``: gate, up, down."""

    gate: str
    up: str
    down: str


class Experts(nn.Module, CheckpointShards):
    """``num_experts`` SwiGLU experts, stacked until :meth:`unstack_`; expert ``e`` loads from
    ``<e>.<names.gate>.weight`` ...

    With tensor parallelism every rank holds its block of each expert's width (see ``parallel.py``):
    the sum over ranks of :meth:`forward` is the experts' output."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, names: ExpertNames) -> None:
        super().__init__()
        tp = parallel.current()
        self.width = (
            slice(0, intermediate) if tp.size == 1 else tp.block(intermediate, "the experts' intermediate size")
        )
        width = self.width.stop - self.width.start
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.sharded = tp.size > 1
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.names = names
        self._blocked = [(BlockedCopy(), BlockedCopy()) for _ in range(num_experts)]  # gate_up, down
        self.layers: nn.ModuleList | None = None  # per expert: its gate/up and down Linear, once unstacked

    @property
    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(N, K)`` of each expert's gate/up and down projections (this rank's)."""
        width = self.width.stop - self.width.start
        return (2 * width, self.hidden), (self.hidden, width)

    def unstack_(self) -> None:
        """Replace the stacked parameters by one :class:`Linear` per expert and projection (gate/up
        ``[2I, hidden]``, down ``[hidden, I]``; :attr:`layers`) whose weight is the expert's slice of
        the stack (a view: nothing is copied, and the stack's memory goes with the last view). From
        then on the products use those layers, and :meth:`checkpoint_shards` lists the weights they
        still have (a quantized layer has none)."""
        layers = nn.ModuleList()
        for e in range(self.num_experts):
            pair = nn.ModuleList()
            for stacked in (self.gate_up_proj, self.down_proj):
                n, k = stacked.shape[1:]
                with torch.device("meta"):
                    layer = Linear(k, n, bias=False)
                layer.weight = nn.Parameter(stacked[e].detach(), requires_grad=stacked.requires_grad)
                pair.append(layer)
            layers.append(pair)
        del self.gate_up_proj, self.down_proj
        self._blocked = []
        self.layers = layers

    def quantize_(self, scheme: QuantScheme, panels: Callable[[Linear], bool]) -> list[Linear]:
        """Keep every expert's projections quantized with ``scheme`` from now on (unstacked first:
        :meth:`unstack_`), in the panels layout where ``panels`` says so. Returns the layers it
        quantized (those not quantized yet). Raises ValueError, changing nothing, unless the scheme's
        groups fit both projections' K (see ``QuantScheme.group_for``)."""
        for _, k in self.shapes:
            scheme.group_for(k)
        if self.layers is None:
            self.unstack_()
        assert self.layers is not None
        quantized = []
        for layer in (layer for pair in self.layers for layer in pair):
            if layer.quantization is None:
                layer.quantize_(scheme, panels(layer))
                quantized.append(layer)
        return quantized

    def checkpoint_shards(self) -> list[CheckpointShard]:
        width = self.width.stop - self.width.start
        full, hidden = self.intermediate, self.hidden
        rows = parallel.CheckpointPart((full, hidden), (self.width,)) if self.sharded else None
        cols = parallel.CheckpointPart((hidden, full), (slice(None), self.width)) if self.sharded else None
        shards: list[CheckpointShard] = []
        for e in range(self.num_experts):
            gate_up, down = self._weights(e)
            if gate_up is not None:
                param, at = gate_up
                shards += [
                    (f"{e}.{self.names.gate}.weight", param, (*at, slice(0, width)), rows),
                    (f"{e}.{self.names.up}.weight", param, (*at, slice(width, 2 * width)), rows),
                ]
            if down is not None:
                shards.append((f"{e}.{self.names.down}.weight", *down, cols))
        return shards

    def _weights(self, e: int) -> tuple[tuple[nn.Parameter, tuple[int, ...]] | None, ...]:
        """Expert ``e``'s gate/up and down weights, each as ``(parameter, index of the expert's
        matrix in it)``; None for a layer without a weight parameter (quantized)."""
        if self.layers is None:
            return (self.gate_up_proj, (e,)), (self.down_proj, (e,))
        return tuple((layer.weight, ()) if "weight" in layer._parameters else None for layer in self.layers[e])

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]``; ``expert_ids``/``weights`` ``[T, k]``: each token's experts and their
        weights. Returns ``sum_k weights[t, k] * expert(x[t])`` in ``x``'s dtype."""
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // top_k
        routed = x[token_of]
        pair_weights = weights.reshape(-1)[order, None]
        outputs = torch.empty_like(routed)
        start = 0
        for e, n in enumerate(counts):  # experts without tokens do no work
            rows = slice(start, start + n)
            if n:
                outputs[rows] = (self._expert(e, routed[rows]) * pair_weights[rows]).to(x.dtype)
            start += n
        return torch.zeros_like(x).index_add_(0, token_of, outputs)

    def make_blocked_copies(self) -> None:
        """Make the stacked experts' blocked copies now (:meth:`BlockedCopy.make_now`); unstacked
        experts are :class:`Linear` layers, which make their own."""
        if self.layers is None:
            for e, (gate_up_copy, down_copy) in enumerate(self._blocked):
                gate_up_copy.make_now(self.gate_up_proj[e])
                down_copy.make_now(self.down_proj[e])

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU MLP on its tokens ``x``."""
        if self.layers is not None:
            gate_up, down = self.layers[e]
            return down(silu_and_mul(gate_up(x)))
        gate_up_copy, down_copy = self._blocked[e]
        hidden = silu_and_mul(blocked_linear(x, self.gate_up_proj[e], None, gate_up_copy))
        return blocked_linear(hidden, self.down_proj[e], None, down_copy)


class SparseMoE(nn.Module):
    """Router (``gate.weight`` ``[E, hidden]``) and experts; the family picks the weights' dtype
    (``scores_in_input_dtype``: Qwen3-MoE rounds them to the activations' dtype, Mixtral keeps fp32)."""

    def __init__(self, hidden: int, moe: MoEConfig, names: ExpertNames, scores_in_input_dtype: bool) -> None:
        super().__init__()
        self.gate = Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size, names)
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.scores_in_input_dtype = scores_in_input_dtype
        self.tp = parallel.current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scores_in_input_dtype:
            weights = weights.to(x.dtype)
        out = self.experts(x, expert_ids, weights)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


def parse_moe(
    raw: dict[str, Any], intermediate_key: str, renormalize: bool, sparse_layers: frozenset[int]
) -> MoEConfig:
    """The MoE settings in config.json's ``raw`` (expert count under ``num_local_experts`` or
    ``num_experts``, expert width under ``intermediate_key``, ``num_experts_per_tok``);
    :class:`ModelConfigError` when invalid."""
    experts_key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    values = {}
    for key in (experts_key, "num_experts_per_tok", intermediate_key):
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"config.json: {key!r} must be a positive integer, got {value!r}")
        values[key] = value
    if values["num_experts_per_tok"] > values[experts_key]:
        raise ModelConfigError(
            f"config.json: num_experts_per_tok ({values['num_experts_per_tok']}) exceeds {experts_key} "
            f"({values[experts_key]})"
        )
    return MoEConfig(
        num_experts=values[experts_key],
        top_k=values["num_experts_per_tok"],
        intermediate_size=values[intermediate_key],
        renormalize=renormalize,
        sparse_layers=sparse_layers,
    )
