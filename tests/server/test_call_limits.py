"""A completions call with more prompts than the waiting queue can ever hold is a 400 at once, naming
``prompt`` (before any prompt is tokenized or queued), not a retryable 429 after a long wait."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.server.conftest import MODEL, serve
from tokenmill import Engine


def test_more_prompts_than_the_queue_holds_is_a_400_at_once(checkpoint: Path) -> None:
    engine = Engine(dtype="float32", model=str(checkpoint), num_kv_slots=1024, max_waiting_requests=4)
    with serve(engine) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:  # before: queued, aborted, then a 429
            client.completions.create(model=MODEL, prompt=["hello"] * 5, max_tokens=2)
        assert refused.value.body["param"] == "prompt" and "at most 4" in refused.value.body["message"]
        ok = client.completions.create(model=MODEL, prompt=["hello"] * 4, max_tokens=2)
        assert len(ok.choices) == 4


def test_chat_text_too_long_for_the_context_is_refused_before_the_template() -> None:
    """3 MB of message text (the body limit is 4 MiB) cannot fit a 2048-token context whatever its
    tokens: a 400 before the chat template (and the tokenizer) runs; a small chat still answers."""
    engine = Engine(dtype="float32", num_kv_slots=1024)  # the tiny model: byte-level BPE, a bounded bytes/token
    templated = []
    template = engine.tokenizer.apply_chat_template
    engine.tokenizer.apply_chat_template = lambda *args, **kwargs: templated.append(1) or template(*args, **kwargs)
    with serve(engine) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        huge = [{"role": "user", "content": "word " * 600_000}]
        with pytest.raises(openai.BadRequestError, match="context limit"):
            client.chat.completions.create(model="tiny-model", messages=huge, max_tokens=2)
        assert templated == []
        small = client.chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert small.choices[0].finish_reason in ("length", "stop") and templated == [1]
