"""The OpenAI routes through the official ``openai`` client, checked against the engine's own output."""

from __future__ import annotations

import math

import openai
import pytest

from tests.server.conftest import MODEL, Server, engine_generate
from tokenmill import SamplingParams

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_prompt(server: Server, messages: list[dict]) -> list[int]:
    return server.engine.tokenizer.apply_chat_template(messages)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "tokenmill"
    assert models[0].model_extra["quantization"] is None  # an unquantized engine


def test_chat_equals_engine_output_with_exact_usage(client: openai.OpenAI, server: Server) -> None:
    prompt = chat_prompt(server, MESSAGES)
    truth = engine_generate(server.engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **GREEDY)
    assert reply.object == "chat.completion" and reply.model == MODEL
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == truth.outputs[0].text
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 10
    assert reply.usage.total_tokens == len(prompt) + 10
    # max_completion_tokens is the newer name of max_tokens
    newer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, **GREEDY)
    assert newer.choices[0].message.content == choice.message.content


def test_chat_stream_concatenates_to_the_full_reply(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_n_completions_sum_their_tokens(client: openai.OpenAI, server: Server) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_tokens=7, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert reply.usage.prompt_tokens == len(chat_prompt(server, MESSAGES))  # once, not per choice
    assert reply.usage.completion_tokens == 14


def test_seed_reproduces_a_sampled_reply(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
        )
        return reply.choices[0].message.content

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_stop_cuts_exactly_where_the_unstopped_text_has_it(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    text = full.choices[0].message.content
    words = text.split()
    stop = f"{words[3]} {words[4]}"
    expected = text[: text.index(stop)]
    stopped = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stop=[stop], **GREEDY)
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    prompt = "the cat sat on the mat"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY).choices[0].text
    stop = plain.split()[2]
    kept = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        stop=stop,
        **{**GREEDY, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
    )
    assert kept.choices[0].text == plain[: plain.index(stop) + len(stop)]


def test_completions_accept_every_prompt_form(client: openai.OpenAI, server: Server) -> None:
    tokenizer = server.engine.tokenizer
    texts = ["hello world", "the cat sat on the mat"]
    ids = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    truth = [engine_generate(server.engine, p, params).outputs[0].text for p in ids]
    for prompt, expected in [(texts[0], truth[:1]), (texts, truth), (ids[1], truth[1:]), (ids, truth)]:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
        assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
        n_prompts = len(expected)
        used = ids if n_prompts == 2 else ([ids[0]] if prompt == texts[0] else [ids[1]])
        assert reply.usage.prompt_tokens == sum(len(p) for p in used)
        assert reply.usage.completion_tokens == 6 * n_prompts
    two_each = client.completions.create(model=MODEL, prompt=texts, n=2, max_tokens=3, temperature=1.0, seed=1)
    assert sorted(c.index for c in two_each.choices) == [0, 1, 2, 3]


def test_completions_default_to_16_tokens_and_stream(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="hello", extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["hello", "the cat"],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    by_choice: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            by_choice[c.index] = by_choice.get(c.index, "") + c.text
    whole = client.completions.create(model=MODEL, prompt=["hello", "the cat"], max_tokens=5, **GREEDY)
    assert by_choice == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage == whole.usage


def test_chat_logprobs_shape(client: openai.OpenAI, server: Server) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    assert " ".join(item.token for item in content) == reply.choices[0].message.content.strip()
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.logprob == pytest.approx(values[0])  # greedy picks the most likely token
        assert all(v <= 0 for v in values)
    assert sum(math.exp(v) for v in values) < 1
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, stream=True, **GREEDY
    )
    tokens = [item.token for c in streamed if c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert tokens == [item.token for item in content]
    only_chosen = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True, **GREEDY)
    assert [item.top_logprobs for item in only_chosen.choices[0].logprobs.content] == [[], []]


def test_completions_logprobs_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, logprobs=2, **GREEDY)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert " ".join(lp.tokens) == reply.choices[0].text.strip()
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(value) == pytest.approx(max(top.values()))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_logit_bias_and_vllm_extras(client: openai.OpenAI, server: Server) -> None:
    cat = server.engine.tokenizer.encode("cat")[0]
    forced = client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=3,
        temperature=0.7,
        logit_bias={str(cat): 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text.split() == ["cat"] * 3
    stop_id = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=5, logit_bias={str(cat): 100}, extra_body={"stop_token_ids": [cat]}
    )
    assert stop_id.choices[0].finish_reason == "stop" and stop_id.usage.completion_tokens == 1
    shaped = client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
        user="u-1",
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.2,
            "min_tokens": 8,
            "skip_special_tokens": False,
        },
    )
    assert shaped.usage.completion_tokens == 8 and shaped.choices[0].finish_reason == "length"


def expected_prompt_logprobs(server: Server, entries: list) -> list:
    """vLLM's JSON shape of ``RequestOutput.prompt_logprobs``."""
    decode = server.engine.tokenizer.decode
    return [None] + [
        {
            str(t): {
                "logprob": pytest.approx(lp.logprob, abs=1e-5),
                "rank": lp.rank,
                "decoded_token": decode([t], skip_special_tokens=False),
            }
            for t, lp in entry.items()
        }
        for entry in entries[1:]
    ]


def test_completions_echo_leads_with_the_prompt_and_its_logprobs(client: openai.OpenAI, server: Server) -> None:
    prompt = "the cat sat on the"
    ids = server.engine.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    truth = engine_generate(server.engine, ids, params)
    out = truth.outputs[0]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, echo=True, **GREEDY)
    (choice,) = reply.choices
    assert choice.text == prompt + out.text
    lp = choice.logprobs
    all_ids = ids + out.token_ids
    strings = [server.engine.tokenizer.decode([t], skip_special_tokens=False) for t in all_ids]
    assert lp.tokens == strings
    assert lp.text_offset == [sum(len(s) for s in strings[:i]) for i in range(len(strings))]
    entries = truth.prompt_logprobs + out.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [entry[t].logprob for t, entry in zip(all_ids[1:], entries[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    decode = server.engine.tokenizer.decode
    for top, entry in zip(lp.top_logprobs[1:], entries[1:]):
        assert top == pytest.approx({decode([t], skip_special_tokens=False): v.logprob for t, v in entry.items()})
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, echo=True, stream=True, **GREEDY
    )
    chunks = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks if c.finish_reason is None for t in c.logprobs.tokens] == lp.tokens
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True, **GREEDY).choices[0]
    assert plain.text == server.engine.tokenizer.decode(ids) + out.text and plain.logprobs is None


def test_vllm_prompt_logprobs_on_completions_and_chat(client: openai.OpenAI, server: Server) -> None:
    ids = server.engine.tokenizer.encode("the cat sat")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    truth = engine_generate(server.engine, ids, params)
    reply = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, n=2, temperature=0, extra_body={"prompt_logprobs": 1, "ignore_eos": True}
    )
    for choice in reply.choices:
        assert choice.model_extra["prompt_logprobs"] == expected_prompt_logprobs(server, truth.prompt_logprobs)
    prompt = chat_prompt(server, MESSAGES)
    truth = engine_generate(server.engine, prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0.0, extra_body={"prompt_logprobs": 0})
    chat = client.chat.completions.create(**body)
    expected = expected_prompt_logprobs(server, truth.prompt_logprobs)
    assert chat.model_extra["prompt_logprobs"] == expected
    assert all(len(entry) == 1 for entry in expected[1:])  # k=0: only the actual prompt token
    streamed = [c.model_extra.get("prompt_logprobs") for c in client.chat.completions.create(**body, stream=True)]
    assert [p for p in streamed if p is not None] == [expected]


def test_the_finish_chunk_carries_no_text(client: openai.OpenAI) -> None:
    """As OpenAI streams: each choice's ``finish_reason`` comes in a chunk of its own with an empty
    delta, so a client that stops reading a choice at its first ``finish_reason`` has all its text."""
    sampled = dict(n=2, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **sampled)
    texts: dict[int, str] = {0: "", 1: ""}
    finished: set[int] = set()
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **sampled):
        for choice in chunk.choices:
            assert choice.index not in finished, "a chunk after the choice's finish_reason"
            if choice.finish_reason is not None:
                assert choice.delta.content is None and choice.delta.role is None and not choice.delta.tool_calls
                finished.add(choice.index)
            else:
                texts[choice.index] += choice.delta.content or ""
    assert finished == {0, 1} and texts == {c.index: c.message.content for c in whole.choices}

    prompts = ["hello", "the cat"]
    whole = client.completions.create(model=MODEL, prompt=prompts, echo=True, **sampled)
    texts = {i: "" for i in range(4)}
    finished = set()
    for chunk in client.completions.create(model=MODEL, prompt=prompts, echo=True, stream=True, **sampled):
        for choice in chunk.choices:
            assert choice.index not in finished, "a chunk after the choice's finish_reason"
            if choice.finish_reason is not None:
                assert choice.text == "" and choice.logprobs is None
                finished.add(choice.index)
            else:
                texts[choice.index] += choice.text
    assert finished == {0, 1, 2, 3} and texts == {c.index: c.text for c in whole.choices}


def test_cached_tokens_are_the_engines_prefix_cache_hits(client: openai.OpenAI, server: Server) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` is the engine's own count of prompt tokens
    served from the prefix cache: a repeated prompt hits the cache, whole or streamed."""
    ids = server.engine.tokenizer.encode("a dog sat on the mat the dog x y")
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, **GREEDY)
    streamed = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    streamed_usage = list(streamed)[-1].usage
    truth = engine_generate(server.engine, ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert 0 < truth.num_cached_tokens < len(ids)
    assert first.usage.prompt_tokens_details.cached_tokens < truth.num_cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == truth.num_cached_tokens
    assert streamed_usage.prompt_tokens_details.cached_tokens == truth.num_cached_tokens

    messages = [{"role": "user", "content": "x y the dog on a mat"}]
    for _ in range(2):
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    streamed_usage = list(streamed)[-1].usage
    prompt = chat_prompt(server, messages)
    truth = engine_generate(server.engine, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert 0 < truth.num_cached_tokens < len(prompt)
    assert chat.usage.prompt_tokens_details.cached_tokens == truth.num_cached_tokens
    assert streamed_usage.prompt_tokens_details.cached_tokens == truth.num_cached_tokens
