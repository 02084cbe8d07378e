"""Seeded texts of made-up words, a WordPiece tokenizer trained on them, and texts cut to an exact
token count: the encoder benchmarks' inputs, built offline and deterministically.

:func:`word_texts` draws words Zipf-like from a seeded lexicon (frequent words become whole
tokens, rare ones split into pieces); :func:`save_wordpiece` trains a lowercasing BERT WordPiece
vocabulary on a corpus with the ``tokenizers`` library and saves it as ``BertTokenizerFast``;
:func:`cut_to_tokens` cuts each text at a token boundary so that it tokenizes to the wanted count.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

SYLLABLES = "ka to ri mu sen do la vi ne por tal ex im ur gen bra cho fel sta qui on ar es ul ben mor".split()


def word_texts(seed: int, counts: list[int], lexicon_size: int = 100000) -> list[str]:
    """One text of ``counts[i]`` words for each ``i``, seeded (the first ``k`` texts depend only on
    the first ``k`` counts)."""
    rng = random.Random(seed)
    lexicon = sorted({"".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(lexicon_size)})
    rng.shuffle(lexicon)
    cumulative = list(itertools.accumulate(1 / rank for rank in range(1, len(lexicon) + 1)))
    return [" ".join(rng.choices(lexicon, cum_weights=cumulative, k=count)) for count in counts]


def save_wordpiece(folder: Path, corpus: list[str], max_length: int, vocab_size: int = 30522) -> None:
    """Train a WordPiece vocabulary of at most ``vocab_size`` on ``corpus`` and save it to
    ``folder`` as ``BertTokenizerFast`` (lowercasing, ``max_length`` tokens)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    trainer = BertWordPieceTokenizer(lowercase=True)
    # The trainer numbers the "##" pieces of single characters in hash order, which breaks ties
    # between merges differently from run to run; given up front (in order) they have fixed ids.
    pieces = [f"##{char}" for char in sorted(set("".join(corpus).lower()) - {" "})]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer.train_from_iterator(corpus, vocab_size=vocab_size, special_tokens=specials + pieces, show_progress=False)
    tokenizer = BertTokenizerFast(vocab=trainer.get_vocab(), do_lower_case=True, model_max_length=max_length)
    tokenizer.save_pretrained(folder)


def cut_to_tokens(folder: Path, texts: list[str], counts: list[int], special_tokens: bool = True) -> list[str]:
    """Each text cut to tokenize to exactly ``counts[i]`` tokens with ``folder``'s tokenizer (its
    special tokens included when ``special_tokens``); ValueError for a text too short or one whose
    cut tokenizes otherwise."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cut = []
    for text, count in zip(texts, counts):
        bare = tokenizer.encode(text, add_special_tokens=False)
        keep = count - (len(tokenizer.encode(text).ids) - len(bare.ids) if special_tokens else 0)
        if not 1 <= keep <= len(bare.ids):
            raise ValueError(f"a text of {len(bare.ids)} tokens cannot be cut to {count}")
        piece = text[: bare.offsets[keep - 1][1]]
        if len(tokenizer.encode(piece, add_special_tokens=special_tokens).ids) != count:
            raise ValueError(f"{piece[-40:]!r} does not tokenize to {count} tokens")
        cut.append(piece)
    return cut
