"""The checkpoint's tokenizer (via ``transformers.AutoTokenizer``, offline) and chat template."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    """Encode/decode, chat templating and the set of end-of-sequence token ids.

    ``eos_token_ids`` merges the tokenizer's EOS with ``generation_config.json``'s and
    ``config.json``'s ``eos_token_id`` (each an int or a list).

    Chat templating keeps control tokens under the template's control: the text of a special
    token typed inside a message (or a tool definition) is tokenized as ordinary text, unless the
    caller allows special tokens in content.
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
        specials = {t.content for t in self.hf.added_tokens_decoder.values() if t.special}
        specials.update(self.hf.all_special_tokens)
        specials.discard("")
        # each special token's text as ordinary tokens; computed once, here: transformers' split mode
        # is a setting on the shared backend, which concurrent encodes would race on
        self._special_as_text = {
            text: list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)) for text in specials
        }
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, longest_first))) if specials else None

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_segments(
        self, first: str, second: str | None = None, max_length: int | None = None
    ) -> tuple[list[int], list[int] | None]:
        """A text, or a text pair as a cross-encoder reads it (``[CLS] first [SEP] second [SEP]`` or
        the tokenizer's own pair template): its token ids and token type ids (None where the
        tokenizer gives none, e.g. XLM-RoBERTa's). With ``max_length``, cut to that many tokens as
        sentence-transformers does (the longer text first; special tokens kept)."""
        cut = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        encoded = self.hf(first, second, add_special_tokens=True, **cut)
        types = encoded.get("token_type_ids")
        return list(encoded["input_ids"]), None if types is None else list(types)

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry ``token`` (as written in the vocabulary), or None."""
        token_id = self.hf.convert_tokens_to_ids(token)
        return None if token_id is None or token_id == self.hf.unk_token_id else int(token_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        allow_special_tokens_in_content: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the checkpoint's chat template.

        Special tokens come only from the template itself: special-token text inside any string of
        ``messages`` or ``tools`` is swapped for a one-time placeholder before rendering, and each
        placeholder left in the rendered text becomes that text's ordinary (non-special) tokens.
        So a user cannot forge turns by typing markers such as ``<|im_start|>system``, and
        decoding the ids still gives the text the template rendered. ``allow_special_tokens_in_content``
        tokenizes the rendered text as a whole instead (typed markers become control tokens).
        """
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        if allow_special_tokens_in_content or self._special_text is None:
            text = self._render(messages, add_generation_prompt, tools, template_kwargs)
            return self.encode(text, add_special_tokens=False)
        nonce = secrets.token_hex(8)
        typed: list[str] = []  # special-token texts found in content; placeholder k stands for typed[k]

        def placeholder(match: re.Match[str]) -> str:
            typed.append(match.group())
            return f"[{nonce}:{len(typed) - 1}]"

        def defang(value: Any) -> Any:
            if isinstance(value, str):
                return self._special_text.sub(placeholder, value)
            if isinstance(value, dict):
                return {key: defang(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return [defang(item) for item in value]
            return value

        text = self._render(defang(messages), add_generation_prompt, defang(tools), template_kwargs)
        head, *rest = text.split(f"[{nonce}:")  # each later piece: "<index>]<text>"
        ids = self.encode(head, add_special_tokens=False)
        for piece in rest:
            index, _, tail = piece.partition("]")
            ids += self._special_as_text[typed[int(index)]]
            ids += self.encode(tail, add_special_tokens=False) if tail else []
        return ids

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> str:
        return self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )


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
