"""The checkpoint's tokenizer (via ``transformers.AutoTokenizer``, offline) and chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    """Encode/decode, chat templating and the set of end-of-sequence token ids.

    ``eos_token_ids`` merges the tokenizer's EOS with ``generation_config.json``'s and
    ``config.json``'s ``eos_token_id`` (each an int or a list).
    """

    def __init__(self, path: str | Path) -> None:
        folder = Path(path)
        try:
            self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"cannot load a tokenizer from {folder}: {exc}") from exc
        self.eos_token_ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            self.eos_token_ids.add(int(self.hf.eos_token_id))
        for name in ("generation_config.json", "config.json"):
            self.eos_token_ids.update(_eos_ids_in(folder / name))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the checkpoint's chat template."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        text = self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)


def _eos_ids_in(path: Path) -> list[int]:
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []
