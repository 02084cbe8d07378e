"""A tiny word-level tokenizer with a chat template, built in-process and saved HF-style."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<|end|>"]
WORDS = [
    "hello",
    "world",
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "def",
    "return",
    "x",
    "y",
    "+",
    "=",
    "(",
    ")",
    ":",
    "user",
    "assistant",
    "system",
    "is",
    "and",
    "not",
    "stop",
    "here",
    "one",
    "two",
    "three",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def save_tiny_tokenizer(path: Path, vocab_size: int = 97) -> PreTrainedTokenizerFast:
    """Word-level vocab: specials, ``WORDS``, then filler tokens ``w<i>`` up to ``vocab_size``."""
    vocab_list = SPECIALS + WORDS
    vocab_list += [f"w{i}" for i in range(vocab_size - len(vocab_list))]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(vocab_list)}, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|end|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    return tok
