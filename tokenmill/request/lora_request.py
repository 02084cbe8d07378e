"""LoRARequest: the LoRA adapter a request is generated with (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A request's LoRA adapter, with vLLM's names: ``lora_name`` names an adapter the engine has
    loaded; with ``lora_path`` (a PEFT adapter folder) ``LLM.generate`` loads it under that name
    first if it is not loaded yet. ``lora_int_id`` is accepted for vLLM compatibility and unused."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None
