"""Tests for tokenmill.engine.detokenizer.IncrementalDetokenizer."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.tiny_tokenizer import save_tiny_tokenizer
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.request import SamplingParams
from tokenmill.tokenizer import Tokenizer

MULTIBYTE = "héllo wörld 日本語 😀 and ünïcode ✓ done"


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("words")
    save_tiny_tokenizer(path)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Byte-level BPE with few merges: most non-ASCII characters span several tokens."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    raw.train_from_iterator(["hello world", "the cat sat on the mat", "héllo"] * 20, trainer)
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(path)
    return Tokenizer(path)


def stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed ``ids`` one by one, taking a delta after each; the last entry is the final flush."""
    deltas = []
    for token in ids:
        det.add_token(token)
        deltas.append(det.take_delta(finished=False))
    deltas.append(det.take_delta(finished=True))
    return deltas


def words_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("prompt", ["", "the cat sat"])
def test_multibyte_characters_split_across_tokens_stream_cleanly(byte_bpe: Tokenizer, prompt: str) -> None:
    ids = byte_bpe.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in byte_bpe.decode([t]) for t in ids), "the test needs characters split across tokens"
    det = IncrementalDetokenizer(byte_bpe, byte_bpe.encode(prompt, add_special_tokens=False), SamplingParams())
    deltas = []
    for token in ids:
        det.add_token(token)
        assert "\ufffd" not in det.text
        deltas.append(det.take_delta(finished=False))
    deltas.append(det.take_delta(finished=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == det.text == byte_bpe.decode(ids) == MULTIBYTE


def test_decodes_a_bounded_window_not_the_whole_output(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(MULTIBYTE * 8, add_special_tokens=False)
    seen: list[int] = []
    original = byte_bpe.decode

    class Spy(Tokenizer):
        def __init__(self) -> None:
            self.hf = byte_bpe.hf

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(token_ids))
            return original(token_ids, skip_special_tokens=skip_special_tokens)

    det = IncrementalDetokenizer(Spy(), [], SamplingParams())
    for token in ids:
        det.add_token(token)
    assert det.text == MULTIBYTE * 8
    assert max(seen) <= 8 < len(ids)


def test_context_from_the_prompt_keeps_the_leading_space(words: Tokenizer) -> None:
    det = IncrementalDetokenizer(words, words_ids(words, "user : hello"), SamplingParams())
    assert "".join(stream(det, words_ids(words, "world the cat"))) == det.text == " world the cat"


@pytest.mark.parametrize(
    ("stop", "expected"),
    [("cat s", "hello world the "), ("e c", "hello world th"), ("d t", "hello worl")],
)
def test_stop_string_across_token_boundaries(words: Tokenizer, stop: str, expected: str) -> None:
    ids = words_ids(words, "hello world the cat sat on the mat")
    params = SamplingParams(stop=stop)

    batch = IncrementalDetokenizer(words, [], params)
    for token in ids:
        batch.add_token(token)
    assert batch.text == expected
    assert batch.stopped_by == stop

    streamed = IncrementalDetokenizer(words, [], params)
    deltas = stream(streamed, ids)
    assert "".join(deltas) == streamed.text == expected
    assert streamed.stopped_by == stop


def test_stop_is_detected_at_the_token_that_completes_it(words: Tokenizer) -> None:
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=["cat s"]))
    for word in ["hello", "world", "the", "cat"]:
        det.add_token(words_ids(words, word)[0])
        assert det.stopped_by is None
    det.add_token(words_ids(words, "sat")[0])
    assert det.stopped_by == "cat s"
    det.add_token(words_ids(words, "on")[0])  # ignored once stopped
    assert det.text == "hello world the "


def test_include_stop_str_in_output(words: Tokenizer) -> None:
    ids = words_ids(words, "hello world the cat sat on the mat")
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=["e c"], include_stop_str_in_output=True))
    deltas = stream(det, ids)
    assert "".join(deltas) == det.text == "hello world the c"
    assert det.stopped_by == "e c"


def test_partial_match_is_held_back_then_released(words: Tokenizer) -> None:
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=["cat dog"]))
    det.add_token(words_ids(words, "the")[0])
    assert det.take_delta(finished=False) == "the"
    det.add_token(words_ids(words, "cat")[0])
    assert det.take_delta(finished=False) == " "  # "cat" may start "cat dog"
    det.add_token(words_ids(words, "sat")[0])
    assert det.take_delta(finished=False) == "cat sat"
    assert det.take_delta(finished=True) == ""
    assert det.stopped_by is None
    assert det.text == "the cat sat"


def test_final_flush_releases_a_held_partial_match(words: Tokenizer) -> None:
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=["cat dog"]))
    deltas = stream(det, words_ids(words, "the cat"))
    assert deltas == ["the", " ", "cat"]
    assert det.stopped_by is None


def test_streamed_deltas_are_never_retracted(words: Tokenizer) -> None:
    ids = words_ids(words, "the cat sat on the mat and the dog sat")
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=["the dog", "mat and x"]))
    sent = ""
    for token in ids:
        det.add_token(token)
        sent += det.take_delta(finished=False)
        assert det.text.startswith(sent)
    assert det.text == sent == "the cat sat on the mat and "
    assert det.stopped_by == "the dog"


def test_earliest_stop_string_wins(words: Tokenizer) -> None:
    ids = words_ids(words, "hello world the cat sat")
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=["sat", "orld", "wor"]))
    assert "".join(stream(det, ids)) == det.text == "hello "
    assert det.stopped_by == "wor"  # starts before "orld" though listed after it


def test_shorter_stop_string_wins_a_tie(words: Tokenizer) -> None:
    ids = words_ids(words, "hello world the cat")
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=["world", "wor"], include_stop_str_in_output=True))
    assert "".join(stream(det, ids)) == det.text == "hello wor"
    assert det.stopped_by == "wor"


@pytest.mark.parametrize(("skip", "expected"), [(True, "hello world"), (False, "hello world </s>")])
def test_skip_special_tokens(words: Tokenizer, skip: bool, expected: str) -> None:
    det = IncrementalDetokenizer(words, [], SamplingParams(skip_special_tokens=skip))
    assert "".join(stream(det, [*words_ids(words, "hello world"), 2])) == det.text == expected


def reference_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Brute force: the earliest-starting stop string in ``text`` (the shorter on a tie)."""
    found = [(text.find(s), len(s), s) for s in stops if s in text]
    return min(found)[::2] if found else None


def reference_held_back(text: str, stops: list[str]) -> int:
    """Brute force: the longest suffix of ``text`` that is a proper prefix of a stop string."""
    sizes = [k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])]
    return max(sizes, default=0)


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_and_hold_back_match_a_brute_force_search(byte_bpe: Tokenizer, include_stop: bool) -> None:
    """Self-overlapping stop strings over a two-letter alphabet, one character per token, against a
    search of the whole text after every token."""
    rng = random.Random(0)
    char_ids = {c: byte_bpe.encode(c, add_special_tokens=False)[0] for c in "ab"}
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(1, 3))]
        chars = "".join(rng.choice("ab") for _ in range(rng.randint(1, 30)))
        det = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=stops, include_stop_str_in_output=include_stop))
        sent = ""
        for i, char in enumerate(chars):
            det.add_token(char_ids[char])
            expected = reference_stop(chars[: i + 1], stops)
            if expected is not None:
                start, stop = expected
                assert det.stopped_by == stop
                assert det.text == chars[: start + len(stop) if include_stop else start]
                sent += det.take_delta(finished=False)
                assert sent == det.text
                break
            assert det.stopped_by is None and det.text == chars[: i + 1]
            sent += det.take_delta(finished=False)
            assert len(det.text) - len(sent) == reference_held_back(det.text, stops)
        else:
            sent += det.take_delta(finished=True)
        assert sent == det.text


def test_work_per_token_does_not_grow_with_the_output(words: Tokenizer) -> None:
    """Memory allocated while adding tokens and taking their deltas is the same around the 1,000th
    token and the 20,000th (rebuilding the whole text per token would allocate its full length)."""
    sentence = words_ids(words, "the cat sat on the mat and the dog sat on the cat")
    ids = sentence * (20_000 // len(sentence))
    stops = ["the cat sat on the dog", "mat and the dog sat on a", "x"]
    det = IncrementalDetokenizer(words, [], SamplingParams(stop=stops))
    transient = []
    tracemalloc.start()
    try:
        for token in ids:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            det.add_token(token)
            det.take_delta(finished=False)
            transient.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    assert det.stopped_by is None and len(det.text) > 75_000
    early, late = sum(transient[1000:2000]), sum(transient[-1000:])  # sums: the parts list grows now and then
    assert late < 1.5 * early


def test_tokens_without_text_do_not_widen_the_decoded_window(words: Tokenizer) -> None:
    seen: list[int] = []

    class Spy(Tokenizer):
        def __init__(self) -> None:
            self.hf = words.hf

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(token_ids))
            return words.decode(token_ids, skip_special_tokens=skip_special_tokens)

    eos = 2  # a special token: no text with skip_special_tokens
    ids = words_ids(words, "hello") + [eos] * 200 + words_ids(words, "world the cat")
    det = IncrementalDetokenizer(Spy(), [], SamplingParams())
    assert "".join(stream(det, ids)) == det.text == "hello world the cat"
    assert max(seen) <= 20
