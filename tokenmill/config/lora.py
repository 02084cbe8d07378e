"""LoRAOptions: serving PEFT adapters on top of the model."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.options import option


@dataclass(frozen=True)
class LoRAOptions:
    """The LoRA group of :class:`~tokenmill.config.EngineConfig`."""

    enable_lora: bool = option(
        False,
        "Serve LoRA adapters (PEFT folders) on top of the model, chosen per request (vLLM's flag).",
        section="LoRA",
    )
    max_loras: int = option(
        1,
        "Adapters resident at once: a step's requests may use up to this many different adapters; "
        "others wait until a slot frees up (least recently used adapters leave first).",
        section="LoRA",
    )
    max_lora_rank: int = option(
        16,
        "Highest adapter rank accepted; every slot holds matrices of this rank (memory and work grow with it).",
        section="LoRA",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "Adapters loaded at start, each NAME=PATH (a PEFT adapter folder); requests name them "
        "(the API's model field, LoRARequest in Python). Needs enable_lora.",
        section="LoRA",
        metavar="NAME=PATH",
    )

    def __post_init__(self) -> None:
        modules = self.lora_modules
        if isinstance(modules, dict):  # {name: path} from Python
            modules = tuple(f"{name}={path}" for name, path in modules.items())
        object.__setattr__(self, "lora_modules", tuple(modules))
        self.lora_adapters()  # raises on a bad entry
        if self.enable_lora:
            if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
                raise ValueError(
                    f"max_loras must be >= 1 and max_lora_rank in [1, 512], got {self.max_loras}, {self.max_lora_rank}"
                )
        elif self.lora_modules:
            raise ValueError("lora_modules needs enable_lora")

    def lora_adapters(self) -> dict[str, str]:
        """``lora_modules`` as name -> path (ValueError for an entry that is not NAME=PATH, or a name
        given twice)."""
        adapters: dict[str, str] = {}
        for entry in self.lora_modules:
            name, sep, path = str(entry).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entries must be NAME=PATH, got {entry!r}")
            if name.strip() in adapters:
                raise ValueError(f"lora_modules names {name.strip()!r} twice")
            adapters[name.strip()] = path.strip()
        return adapters
