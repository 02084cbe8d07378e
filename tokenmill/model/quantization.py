"""Quantizing a loaded model's projections in place (``EngineConfig.quantization``).

Every :class:`~tokenmill.kernels.linear.Linear` inside the decoder layers (attention and MLP
projections, packed or tensor-parallel shards alike: rows are quantized independently and groups
run along this rank's K) keeps its weight quantized from then on; what stays in the checkpoint's
precision: embeddings, the LM head, norms, MoE routers (modules named ``gate``) and stacked MoE
experts. On CPU the remaining tensors and the quantized ones are then moved into one fresh
huge-page mapping, which frees the full-precision projections.

The layout (``quant_format``) is chosen per model: a bf16 model on a CPU with the int8 kernel
(AVX512-VNNI) keeps the projections whose output width is a multiple of 16 in the panels layout
(activations quantized to int8 per block, integer products); fp32 models, other CPUs and other
widths keep the rows layout (fp32 products on the dequantized values).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TypeVar

import torch

from tokenmill.config import EngineConfig
from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import PANEL, QuantScheme, dequantize, fake_quantize_activations, quantize
from tokenmill.kernels.quant_linear import STREAM_MAX_ROWS, activation_block, int8_dot_products
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.huge_pages import move_to_huge_pages

logger = logging.getLogger("tokenmill.model")

LinearT = TypeVar("LinearT", bound=torch.nn.Linear)
ROUTER_NAME = "gate"
"""The attribute name of an MoE router, which stays unquantized (its scores pick experts)."""


def quantization_scheme(config: EngineConfig) -> QuantScheme | None:
    """The scheme ``config`` asks for (None: no quantization)."""
    if config.quantization is None:
        return None
    bits = 8 if config.quantization == "int8" else 4
    return QuantScheme(bits, config.quantization_group_size, symmetric=bits == 8)


def quantize_model(model: CausalLM, scheme: QuantScheme) -> int:
    """Quantize ``model``'s decoder-layer projections with ``scheme``; returns how many. Every layer's
    shape is checked before any is changed (see :func:`_fitting_projections`)."""
    targets = _fitting_projections(model.model.layers, scheme, Linear)
    before = model.weight_bytes()
    parameter = next(model.parameters())
    int8_activations = parameter.device.type == "cpu" and parameter.dtype == torch.bfloat16 and int8_dot_products()
    kernels: Counter[str] = Counter()
    for module in targets:
        panels = int8_activations and module.out_features % PANEL == 0
        module.quantize_(scheme, panels=panels)
        kernels[f"{module.out_features}x{module.in_features} {_kernel_description(panels)}"] += 1
    model.quantization = scheme
    if parameter.device.type == "cpu":
        move_to_huge_pages([*model.parameters(), *model.buffers()])
    logger.info(
        "quantized %d projections to %s: weights %.1f -> %.1f MB; kernels per shape (N x K): %s",
        len(targets),
        scheme.name,
        before / 2**20,
        model.weight_bytes() / 2**20,
        "; ".join(f"{count} x {shape}" for shape, count in sorted(kernels.items())),
    )
    return len(targets)


def _kernel_description(panels: bool) -> str:
    """How a quantized projection's products run, for the start-up log."""
    if panels:
        return "panels layout: int8 activations x packed weight, any rows (AVX512-VNNI, quant_int8_dot.cpp)"
    return f"rows layout: fp32 streaming (quant_linear.cpp) up to {STREAM_MAX_ROWS} rows, dequantized + oneDNN beyond"


def fake_quantize_projections(layers: torch.nn.Module, scheme: QuantScheme, int8_activations: bool = False) -> int:
    """Replace the weight of every ``nn.Linear`` under ``layers`` (a decoder stack of any
    implementation, e.g. a transformers model's) that :func:`quantize_model` would quantize by its
    quantized-then-dequantized value; returns how many. Rows quantize independently, so separate
    q/k/v (gate/up) weights give what tokenmill's packed ones give: the model then computes what a
    quantized tokenmill model does (for measuring the quantization error, e.g. perplexity, with any
    framework). With ``int8_activations`` each of them also quantizes its input as the panels
    layout's kernel does (a forward pre-hook: ``fake_quantize_activations`` per ``activation_block``)."""
    targets = _fitting_projections(layers, scheme, torch.nn.Linear)
    for module in targets:
        with torch.no_grad():
            module.weight.copy_(dequantize(quantize(module.weight, scheme)))
        if int8_activations:
            block = activation_block(scheme.group_for(module.in_features), module.in_features)
            module.register_forward_pre_hook(
                lambda _, args, block=block: (fake_quantize_activations(args[0], block).to(args[0].dtype),)
            )
    return len(targets)


def _fitting_projections(layers: torch.nn.Module, scheme: QuantScheme, kind: type[LinearT]) -> list[LinearT]:
    """The ``kind`` modules under ``layers`` to quantize (MoE routers excepted). With an explicit
    group size, a layer it does not fit is a ValueError naming it; with the default groups, a layer
    whose input width is no multiple of 32 keeps its precision (logged as a warning)."""
    targets, kept = [], []
    for name, module in layers.named_modules():
        if not isinstance(module, kind) or name.rpartition(".")[2] == ROUTER_NAME:
            continue
        try:
            scheme.group_for(module.in_features)
        except ValueError as exc:
            if scheme.group_size is not None:
                raise ValueError(f"cannot quantize layers.{name} ({scheme.name}): {exc}") from None
            kept.append(f"layers.{name}")
            continue
        targets.append(module)
    if kept:
        logger.warning("%d projection(s) keep their precision (input width no multiple of 32): %s", len(kept), kept)
    return targets
