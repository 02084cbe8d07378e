"""Quantizing a loaded model's projections in place (``EngineConfig.quantization``).

Every :class:`~tokenmill.kernels.linear.Linear` inside the decoder layers (attention and MLP
projections, packed or tensor-parallel shards alike: rows are quantized independently and groups
run along this rank's K) keeps its weight quantized from then on with the scheme asked for; the
LM head (its vocabulary shard, with tensor parallelism) with :data:`LM_HEAD_SCHEME`, int8 per
output channel whatever the scheme (its error goes straight into the logits: 8 bits, as llama.cpp's
4-bit files keep their output matrix at 6-8); a head tied to the embeddings gets one of its own
(:func:`untied_head`, at tp=1), quantized, while the table stays for the lookups. What stays in the
checkpoint's precision: embeddings, norms and MoE routers (modules named ``gate``).
Stacked MoE experts are quantized with the scheme too, each expert's projections becoming quantized
``Linear`` layers (``moe.Experts.quantize_``). On CPU the remaining tensors and the quantized ones
are then moved into one fresh huge-page mapping, which frees the full-precision weights.

The layout (``quant_format``) is chosen per model (:func:`panels_on_cpu`): a bf16 model on a CPU
with the int8 kernel (AVX512-VNNI, or AVX2), and an fp32 one where that kernel is the AVX2 one, keep
the projections whose output width is a multiple of 16 in the panels layout (activations quantized
per block to two int8 passes, value and residual, or to one with ``quantized_activations="int8"``:
:func:`set_activation_passes`; integer products); fp32 models on AVX512-VNNI
CPUs, other CPUs and other widths keep the rows layout (fp32 products on the dequantized values).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TypeVar

import torch

from tokenmill.config.model import ModelOptions
from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import PANEL, QuantScheme, dequantize, fake_quantize_activations, quantize
from tokenmill.kernels.quant_linear import STREAM_MAX_ROWS, activation_block, int8_dot_isa
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.huge_pages import move_to_huge_pages
from tokenmill.model.moe import Experts

logger = logging.getLogger("tokenmill.model")

LinearT = TypeVar("LinearT", bound=torch.nn.Linear)
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)
LM_HEAD_SCHEME = QuantScheme(8)
"""How a quantized model's LM head (tied or not) is kept, whatever its projections' scheme."""
INT4_DEFAULT_GROUP = 32
"""``quantization="int4"``'s group size unless one is asked for: llama.cpp's Q4_0/Q4_1 groups, whose
scale and min per 32 values (fp16 where exact: ``quant_format.quantize``) cost a bit a weight."""
ROUTER_NAME = "gate"
"""The attribute name of an MoE router, which stays unquantized (its scores pick experts)."""


def quantization_scheme(config: ModelOptions) -> QuantScheme | None:
    """The scheme ``config`` asks for (None: no quantization)."""
    if config.quantization is None:
        return None
    if config.quantization == "int8":
        return QuantScheme(8, config.quantization_group_size)
    return QuantScheme(4, config.quantization_group_size or INT4_DEFAULT_GROUP, symmetric=False)


def quantize_model(model: CausalLM, scheme: QuantScheme) -> int:
    """Quantize ``model``'s decoder-layer projections with ``scheme`` and its untied LM head with
    :data:`LM_HEAD_SCHEME`; returns how many modules. Every layer's shape is checked before any is
    changed (see :func:`_fitting_projections`)."""
    targets = _fitting_projections(model.model.layers, scheme, Linear)
    experts = _fitting_experts(model.model.layers, scheme)
    before = model.weight_bytes()
    for module in targets:
        module.quantize_(scheme, panels=keeps_panels(model, module))
    for stack in experts:
        targets += stack.quantize_(scheme, lambda layer: keeps_panels(model, layer))
    head = _quantizable_head(model.lm_head if model.lm_head is not None or model.tp.size > 1 else untied_head(model))
    if head is not None:
        head.quantize_(LM_HEAD_SCHEME, panels=keeps_panels(model, head))
        model.lm_head = head
        targets.append(head)
    model.quantization = scheme
    if next(model.parameters()).device.type == "cpu":
        move_to_huge_pages([*model.parameters(), *model.buffers()])
    logger.info(
        "quantized %d projections to %s: weights %.1f -> %.1f MB; kernels: %s",
        len(targets),
        scheme.name,
        before / 2**20,
        model.weight_bytes() / 2**20,
        kernels_per_shape(targets),
    )
    return len(targets)


def set_activation_passes(model: torch.nn.Module, passes: int) -> int:
    """Have every quantized projection of ``model`` quantize its inputs to ``passes`` int8 passes
    (``QuantizedTensors.activation_passes``; only panels-layout products read it); returns how many."""
    if passes not in (1, 2):
        raise ValueError(f"activation passes must be 1 or 2, got {passes}")
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quantization is not None]
    for module in quantized:
        module.activation_passes = passes
    return len(quantized)


def untied_head(model: CausalLM) -> Linear:
    """A head of its own for a model whose LM head is its embedding table: a :class:`Linear` whose
    weight is the table (shared, on the table's device), to be quantized; the table stays for the
    embedding lookups."""
    table = model.model.embed_tokens.weight
    with torch.device("meta"):
        head = Linear(table.shape[1], table.shape[0], bias=False)
    head.weight = torch.nn.Parameter(table.detach(), requires_grad=False)
    return head


def _fitting_experts(layers: torch.nn.Module, scheme: QuantScheme) -> list[Experts]:
    """The stacked MoE experts under ``layers`` to quantize, checked as :func:`_fitting_projections`
    checks projections (both of an expert's input widths)."""
    stacks = [(name, m, [k for _, k in m.shapes]) for name, m in layers.named_modules() if isinstance(m, Experts)]
    return _fitting(stacks, scheme, "expert stack(s)")


def _quantizable_head(head: LinearT | None) -> LinearT | None:
    """``head`` (an untied LM head) if :data:`LM_HEAD_SCHEME` fits its width, else None (logged)."""
    if head is None:
        return None
    try:
        LM_HEAD_SCHEME.group_for(head.in_features)
    except ValueError:
        logger.warning("the LM head keeps its precision (input width %d, no multiple of 32)", head.in_features)
        return None
    return head


def panels_on_cpu(dtype: torch.dtype) -> bool:
    """Whether a CPU model in ``dtype`` keeps its quantized projections (those whose output width
    is a multiple of 16) in the panels layout, so that their inputs are quantized to int8 passes:
    where the C++ kernels have the int8 path, a bf16 model, or an fp32 one where that path
    is the AVX2 one (there the rows layout's fp32 products cost twice as much: docs/benchmarks.md; with
    AVX512-VNNI, fp32 keeps the rows layout's exact fp32 activations)."""
    isa = int8_dot_isa()
    return bool(isa) and (dtype == torch.bfloat16 or (dtype == torch.float32 and isa == "avx2"))


def keeps_panels(model: CausalLM, module: Linear, device: torch.device | None = None) -> bool:
    """Whether ``module`` of ``model`` (in its dtype, on ``device``: by default its parameters')
    is kept in the panels layout: on CPU where :func:`panels_on_cpu` says so for the model's dtype,
    an output width that is a multiple of 16."""
    parameter = next(model.parameters())
    on_cpu = (device or parameter.device).type == "cpu"
    return on_cpu and module.out_features % PANEL == 0 and panels_on_cpu(parameter.dtype)


def kernels_per_shape(modules: list[Linear]) -> str:
    """Which kernel each shape (N x K) of the quantized ``modules`` runs, for the start-up log."""
    shapes: dict[str, Counter[str]] = {}
    for m in modules:
        shapes.setdefault(_kernel_description(m.qweight.dim() == 3), Counter())[
            f"{m.out_features}x{m.in_features}"
        ] += 1
    return "; ".join(
        f"{kernel}: " + ", ".join(f"{n} x {shape}" for shape, n in sorted(counts.items()))
        for kernel, counts in shapes.items()
    )


def _kernel_description(panels: bool) -> str:
    """How a quantized projection's products run."""
    if panels:
        path = "AVX512-VNNI, quant_int8_dot.cpp" if int8_dot_isa() == "avx512-vnni" else "AVX2, quant_int16_dot.cpp"
        return f"panels layout: int8 activations x packed weight, any rows ({path})"
    return f"rows layout: fp32 streaming (quant_linear.cpp) up to {STREAM_MAX_ROWS} rows, dequantized + oneDNN beyond"


def fake_quantize_model(
    model: torch.nn.Module, scheme: QuantScheme, int8_activations: bool = False, activation_passes: int = 2
) -> int:
    """Make a transformers causal LM (``model.model.layers``, ``get_output_embeddings()``) compute
    what a tokenmill model quantized with ``scheme`` does; returns how many modules changed. Each
    ``nn.Linear`` :func:`quantize_model` would quantize (the decoder projections; the LM head with
    :data:`LM_HEAD_SCHEME` unless it is the embedding table) gets its quantized-then-dequantized
    weight, and so does each expert of a stacked-experts module (``gate_up_proj``/``down_proj``
    ``[E, N, K]``, two per expert in the count). Rows quantize independently, so separate q/k/v
    (gate/up) weights give what tokenmill's packed ones give (for measuring the quantization error,
    e.g. perplexity, with any framework).
    With ``int8_activations`` each of them whose output width the panels layout takes (a multiple
    of 16) also quantizes its input as that layout's kernel does in ``activation_passes`` passes (a
    forward pre-hook: ``fake_quantize_activations`` per ``activation_block``); a model with stacked experts then raises
    ValueError (their products are internal to the module)."""
    targets = [(module, scheme) for module in _fitting_projections(model.model.layers, scheme, torch.nn.Linear)]
    head = _quantizable_head(model.get_output_embeddings())
    if head is not None:
        if head.weight is model.get_input_embeddings().weight:  # tied: the head gets a copy of its own
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        targets.append((head, LM_HEAD_SCHEME))
    stacks = [m for m in model.model.layers.modules() if _stacked_experts(m)]
    if stacks and int8_activations:
        raise ValueError("int8 activations are not modelled inside stacked experts (their products are internal)")
    for stack in stacks:
        for stacked in (stack.gate_up_proj, stack.down_proj):
            with torch.no_grad():
                for e in range(stacked.shape[0]):
                    stacked[e].copy_(dequantize(quantize(stacked[e], scheme)))
    for module, module_scheme in targets:
        with torch.no_grad():
            module.weight.copy_(dequantize(quantize(module.weight, module_scheme)))
        if int8_activations and module.out_features % PANEL == 0:
            block = activation_block(module_scheme.group_for(module.in_features), module.in_features)
            module.register_forward_pre_hook(
                lambda _, args, block=block: (
                    fake_quantize_activations(args[0], block, activation_passes).to(args[0].dtype),
                )
            )
    return len(targets) + 2 * sum(stack.gate_up_proj.shape[0] for stack in stacks)


def _stacked_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds stacked experts as transformers' MoE blocks do (``gate_up_proj``
    ``[E, 2I, hidden]`` and ``down_proj`` ``[E, hidden, I]`` parameters)."""
    params = dict(module.named_parameters(recurse=False))
    return all(name in params and params[name].dim() == 3 for name in ("gate_up_proj", "down_proj"))


def _fitting_projections(layers: torch.nn.Module, scheme: QuantScheme, kind: type[LinearT]) -> list[LinearT]:
    """The ``kind`` modules under ``layers`` to quantize (MoE routers excepted). With an explicit
    group size, a layer it does not fit is a ValueError naming it; with the default groups, a layer
    whose input width is no multiple of 32 keeps its precision (logged as a warning)."""
    projections = [
        (name, module, [module.in_features])
        for name, module in layers.named_modules()
        if isinstance(module, kind) and name.rpartition(".")[2] != ROUTER_NAME
    ]
    return _fitting(projections, scheme, "projection(s)")


def _fitting(candidates: list[tuple[str, ModuleT, list[int]]], scheme: QuantScheme, what: str) -> list[ModuleT]:
    """The ``(name under layers, module, its input widths)`` candidates whose widths ``scheme``'s
    groups fit. With an explicit group size a misfit is a ValueError naming the module; with the
    default groups the module keeps its precision (logged as a warning)."""
    targets, kept = [], []
    for name, module, widths in candidates:
        try:
            for k in widths:
                scheme.group_for(k)
        except ValueError as exc:
            if scheme.group_size is not None:
                raise ValueError(f"cannot quantize layers.{name} ({scheme.name}): {exc}") from None
            kept.append(f"layers.{name}")
            continue
        targets.append(module)
    if kept:
        logger.warning("%d %s keep their precision (an input width no multiple of 32): %s", len(kept), what, kept)
    return targets
