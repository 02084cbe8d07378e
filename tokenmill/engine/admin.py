"""EngineAdmin: the engine's admin room: model weights, LoRA adapters and the prefix cache.

Each operation checks its input on the calling thread (nothing changes when it is refused), then
changes the engine between steps through the loop's :meth:`~tokenmill.engine.loop.EngineLoop.call`;
what every rank must do is one ``ModelWorker`` call through the executor (``stage_weights`` /
``commit_weights``, ``load_lora_slot``). Mixed into :class:`~tokenmill.engine.engine.Engine`, whose
loop thread built :attr:`parts`.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from typing import TypeVar

import torch

from tokenmill.engine.builder import EngineParts
from tokenmill.engine.lora_manager import LoRAManager
from tokenmill.model.lora import LoRAAdapter, LoRAError, check_adapter, read_adapter
from tokenmill.model.weights import WeightError
from tokenmill.worker.weight_update import WeightsSource, WeightsUpdate, next_version, stage_update

T = TypeVar("T")


class EngineAdmin:
    """Weights, LoRA adapters and the prefix cache of a running engine (thread-safe)."""

    # what the engine provides: its parts (built on the loop thread), EngineLoop.call (run a function on
    # the loop thread between steps) and _check_alive, and the facade's _abort_all
    parts: EngineParts
    weight_version: int = 0
    call: Callable[..., object]
    _check_alive: Callable[[], None]
    _abort_all: Callable[[], int]

    def update_weights(
        self,
        weights: WeightsSource,
        *,
        version: int | None = None,
        flush_cache: bool = True,
        abort_running: bool = False,
    ) -> int:
        """Replace model weights between steps; returns the new weight version.

        ``weights``: ``(name, tensor)`` pairs with Hugging Face names (partial updates allowed)
        or a safetensors checkpoint folder. Every tensor is read, validated (finite values
        included) and staged on the calling thread first: an invalid update raises
        :class:`~tokenmill.model.loader.WeightError` (a bad ``version``: ParameterError) and
        leaves the engine exactly as it was. Between steps the version is checked again before
        anything changes; then every rank stages its part (with tensor parallelism the workers
        stage theirs from the whole tensors; if any rank refuses, WeightError naming it, no rank
        applies), and the copy, the cache flush and the version bump happen together.
        In-flight requests keep running (each token is tagged with the version that
        produced it) unless ``abort_running``; ``flush_cache`` drops the prefix cache so no later
        request reuses KV computed under the old weights. ``version`` (an int below 2**63)
        defaults to current + 1 and must increase.
        """
        self._check_alive()
        next_version(self.weight_version, version)  # fail fast, before reading any weights
        parts = self.parts
        executor = parts.executor
        update = WeightsUpdate.of(stage_update(executor.worker.model, weights, keep_whole=executor.ranks > 1))

        def apply() -> int:
            new_version = next_version(self.weight_version, version)
            try:
                votes = executor.call("stage_weights", update)
            except BaseException:  # nothing stays staged (the group, if it failed, is unhealthy now)
                executor.worker.commit_weights(False)
                with contextlib.suppress(Exception):
                    executor.call("commit_weights", False)
                raise
            refusals = [f"tensor-parallel rank {rank} refused the update: {r}" for rank, r in enumerate(votes) if r]
            executor.call("commit_weights", not refusals)
            if refusals:
                raise WeightError("; ".join(refusals))
            if abort_running:
                self._abort_all()
            if flush_cache:
                parts.cache.reset_prefix_cache()
            if parts.tier is not None:  # a namespace no restart computes: these weights are in no file
                parts.cache.rename_tier(f"{parts.checkpoint_namespace}, weights {new_version} {secrets.token_hex(8)}")
            self.weight_version = new_version
            return new_version

        return self._call(apply)

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder ``path`` as adapter ``name`` (read and checked on the calling
        thread: :class:`~tokenmill.model.lora.LoRAError` for an adapter that does not fit; ValueError
        for a name in use); requests may name it once this returns."""
        manager = self._lora_manager()
        adapter = read_adapter(self.parts.executor.worker.model, name, path, manager.max_rank)
        self._call(lambda: manager.register(adapter))

    def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` between steps, freeing its matrices. ValueError while a request that
        has not finished uses it; KeyError for an unknown name."""
        manager = self._lora_manager()

        def unload() -> None:
            users = sum(state.lora_name == name for state in self.parts.requests.requests.values())
            if users:
                raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
            manager.unregister(name)

        self._call(unload)

    def update_lora(self, name: str, tensors: dict[str, torch.Tensor]) -> int:
        """Replace some or all of adapter ``name``'s matrices (PEFT tensor names, e.g.
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; the adapter's settings
        stay); returns its new version. Checked on the calling thread as a loaded adapter is
        (LoRAError, nothing changed), applied between steps at once: running requests go on with the
        new matrices, and prefixes cached under the old version are never matched again."""
        manager = self._lora_manager()
        entry = manager.adapter(name)
        if entry is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        old = entry.adapter
        merged = {f"{module}.lora_A.weight": d.a for module, d in old.deltas.items()}
        merged |= {f"{module}.lora_B.weight": d.b for module, d in old.deltas.items()}
        for key, tensor in tensors.items():
            short = key.removeprefix("base_model.model.")
            if short not in merged:
                raise LoRAError(f"LoRA adapter {name!r}: update names {key!r}, which the adapter does not hold")
            merged[short] = tensor
        model = self.parts.executor.worker.model
        adapter = check_adapter(model, name, old.settings, merged, manager.max_rank, f"update of {old.source}")
        return self._call(lambda: manager.update(adapter))

    def lora_adapters(self) -> dict[str, LoRAAdapter]:
        """The loaded adapters by name (empty without enable_lora)."""
        lora = self.parts.lora
        if lora is None:
            return {}
        return {name: entry.adapter for name in lora.names() if (entry := lora.adapter(name))}

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, on the device and in the host / disk tiers (between steps; running
        sequences keep their KV)."""
        self._call(self.parts.cache.clear_tiers)

    def _lora_manager(self) -> LoRAManager:
        self._check_alive()
        if self.parts.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        return self.parts.lora

    def _call(self, fn: Callable[[], T]) -> T:
        return self.call(fn)  # type: ignore[return-value]
