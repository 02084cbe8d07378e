"""LoRAManager: the engine's adapters by name, which of them hold the model's ``max_loras`` slots,
and the prefix-cache namespace of each adapter's version.

Registered adapters (checked, in host memory) are put into a slot when a sequence using them is
admitted: the slot it already holds, else a free one, else the least recently used slot that no
running sequence uses (its adapter is evicted from the slots, not unregistered). When every slot is
in use by running sequences of other adapters, the sequence waits (``acquire`` returns None).
Running sequences hold a reference on their slot (``acquire`` / ``release``).

An update replaces an adapter's matrices between steps (its slot reloaded in place: running
sequences go on with the new matrices) and bumps its version; the namespace, and so the prefixes
cached under it, is per version, so KV computed with the old matrices is never matched again.
Engine thread only, except :meth:`has`, :meth:`adapter` and :meth:`names` (reads of one dict).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.model.lora import LoRAAdapter, ModuleDelta


@dataclass
class RegisteredAdapter:
    adapter: LoRAAdapter
    version: int = 1
    running: int = 0  # running sequences that use it (their slot reference)
    slot: int | None = None  # the slot it is loaded in, None when in none
    uid: str = field(default_factory=lambda: secrets.token_hex(6))  # a reload under the same name is another adapter

    @property
    def namespace(self) -> str:
        """The prefix-cache namespace of this version."""
        return f"lora {self.adapter.name} {self.uid} v{self.version}"


class LoRAManager:
    def __init__(self, max_loras: int, max_rank: int, load_slot: Callable[[int, list[ModuleDelta]], None]) -> None:
        """``max_loras`` slots of adapters up to ``max_rank``; ``load_slot(slot, deltas)`` puts an
        adapter's matrices into a slot on every rank (the executor's call)."""
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._load_slot = load_slot
        self._adapters: dict[str, RegisteredAdapter] = {}
        self._slot_owner: list[str | None] = [None] * max_loras
        self._recency: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self.slot_loads = 0  # adapters put into a slot (a first use or after an eviction)

    def has(self, name: str) -> bool:
        return name in self._adapters

    def names(self) -> list[str]:
        return list(self._adapters)

    def adapter(self, name: str) -> RegisteredAdapter | None:
        return self._adapters.get(name)

    def register(self, adapter: LoRAAdapter) -> None:
        """Add ``adapter`` under its name (ValueError if the name is taken)."""
        if adapter.name in self._adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        self._adapters[adapter.name] = RegisteredAdapter(adapter)

    def unregister(self, name: str) -> None:
        """Drop adapter ``name`` (KeyError if unknown; ValueError while running sequences use it): its
        slot is emptied and its matrices are no longer held."""
        entry = self._adapters[name]
        if entry.running:
            raise ValueError(f"LoRA adapter {name!r} is in use by {entry.running} running sequence(s)")
        if entry.slot is not None:
            self._load(entry.slot, None)
            self._slot_owner[entry.slot] = None
        del self._adapters[name]

    def update(self, adapter: LoRAAdapter) -> int:
        """Replace the matrices of the adapter of ``adapter.name`` (KeyError if unknown); returns its
        new version. Its slot, if any, is reloaded now."""
        entry = self._adapters[adapter.name]
        entry.adapter = adapter
        entry.version += 1
        if entry.slot is not None:
            self._load(entry.slot, adapter)
        return entry.version

    def version(self, name: str) -> int:
        """Adapter ``name``'s version (1 when loaded, +1 per update; 0 once unloaded)."""
        entry = self._adapters.get(name)
        return 0 if entry is None else entry.version

    def namespace(self, name: str) -> str:
        """The prefix-cache namespace of adapter ``name``'s current version."""
        return self._adapters[name].namespace

    def acquire(self, name: str) -> int | None:
        """A slot holding adapter ``name`` for one more running sequence, loading it into a slot if
        needed; None when no slot can be had now. KeyError for an unknown name."""
        entry = self._adapters[name]
        if entry.slot is None:
            slot = next((s for s in self._recency if self._slot_owner[s] is None), None)
            if slot is None:
                slot = next((s for s in self._recency if self._is_free(s)), None)
            if slot is None:
                return None
            previous = self._slot_owner[slot]
            if previous is not None:
                self._adapters[previous].slot = None
            self._load(slot, entry.adapter)
            self._slot_owner[slot], entry.slot = name, slot
            self.slot_loads += 1
        entry.running += 1
        self._recency.move_to_end(entry.slot)
        return entry.slot

    def release(self, name: str) -> None:
        """Undo one :meth:`acquire` (a sequence stopped running: finished, preempted, aborted)."""
        entry = self._adapters.get(name)
        if entry is not None and entry.running > 0:
            entry.running -= 1

    def snapshot(self) -> dict[str, object]:
        return {
            "loaded": len(self._adapters),
            "resident": sum(owner is not None for owner in self._slot_owner),
            "slots": self.max_loras,
            "slot_loads": self.slot_loads,
        }

    def _load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` (None: nothing) into ``slot`` on every rank."""
        self._load_slot(slot, [] if adapter is None else list(adapter.deltas.values()))

    def _is_free(self, slot: int) -> bool:
        owner = self._slot_owner[slot]
        return owner is None or self._adapters[owner].running == 0
