"""A real llama checkpoint whose greedy output follows a script: each token determines the next.

Every attention and MLP block writes zero into the residual stream (``o_proj`` and ``down_proj``
are zero), so the hidden state at a position is its token's embedding. Scripted tokens get
one-hot embeddings, and ``lm_head`` maps each one's direction to its successor in ``SCRIPT`` with
a margin of ~32 logits, so greedy decoding walks the script from the token that ends the prompt.
The engine, sampler, detokenizer and server run unmodified on it.

The word-level tokenizer's chat template renders the offered tools by name right after the
generation prompt, so the last tool name decides what the model "answers":

- no tools (or ``tool_choice`` "none"): ``:`` -> ``hello world``
- ``get_weather`` last: a Hermes ``<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>``
- ``get_time`` last: a Llama-3 JSON call ``{"name":"get_time", "parameters":{"tz":"UTC"}}``
- ``lookup`` last: plain ``hello world`` (a model that ignores its tool)

History: an assistant tool call renders as ``call NAME CITY`` (the template reads
``arguments['city']``, so arguments must reach it as an object) and a tool message as
``tool : CONTENT``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import make_hf_model

SPECIALS = ["<pad>", "<s>", "</s>", "<|end|>"]
HERMES = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
LLAMA_JSON = ['{"name":"get_time",', '"parameters":{"tz":"UTC"}}']
WORDS = [
    "system",
    "user",
    "assistant",
    "tool",
    ":",
    "call",
    "hello",
    "world",
    "weather",
    "in",
    "Paris",
    "sunny",
    "get_weather",
    "get_time",
    "lookup",
]
VOCAB = SPECIALS + WORDS + HERMES + LLAMA_JSON

SCRIPT = {
    ":": "hello",
    "hello": "world",
    "world": "</s>",
    "lookup": "hello",
    "get_weather": HERMES[0],
    **dict(zip(HERMES, HERMES[1:] + ["</s>"])),
    "get_time": LLAMA_JSON[0],
    LLAMA_JSON[0]: LLAMA_JSON[1],
    LLAMA_JSON[1]: "</s>",
}
HERMES_TEXT = " ".join(HERMES)
LLAMA_JSON_TEXT = " ".join(LLAMA_JSON)

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %} call {{ c['function']['name'] }} {{ c['function']['arguments']['city'] }}"
    "{% endfor %} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% for t in tools or [] %} {{ t['function']['name'] }}{% endfor %}"
    "{% endif %}"
)


def save_scripted_checkpoint(
    path: Path, vocab: list[str] = VOCAB, script: dict[str, str] = SCRIPT, **model_overrides: object
) -> None:
    """The scripted checkpoint (``vocab`` and ``script`` default to this module's; ``model_overrides``
    go to the model's config, e.g. a longer context)."""
    ids = {word: i for i, word in enumerate(vocab)}
    model = make_hf_model("llama", vocab_size=len(vocab), tie_word_embeddings=False, **model_overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for direction, (word, successor) in enumerate(script.items()):
            model.model.embed_tokens.weight[ids[word], direction] = 1.0
            model.lm_head.weight[ids[successor], direction] = 4.0
    model.save_pretrained(path, safe_serialization=True)

    raw = RawTokenizer(models.WordLevel(ids, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
