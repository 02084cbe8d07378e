from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_tokenizer import save_tiny_tokenizer
from tokenmill.tokenizer import Tokenizer


def test_encode_decode_chat_and_eos_ids(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert ids == [4, 5]
    assert tok.decode(ids) == "hello world"
    assert tok.eos_token_ids == {2, 3}
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert tok.decode(chat, skip_special_tokens=False) == "user : hello <|end|> assistant :"


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="cannot load a tokenizer from"):
        Tokenizer(tmp_path / "absent")
