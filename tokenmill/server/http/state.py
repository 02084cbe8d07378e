"""ServerState: what every route needs — the engine, the served model's name (and its LoRA
adapters' names), tokenizer work.

Tokenizer work (encoding, chat templating, token strings for logprobs) runs on the AsyncEngine's
tokenizer pool, never on the event loop; a text prompt too long for the context whatever its
tokens is refused before it is tokenized.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import jinja2
from fastapi import Depends, Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine
from tokenmill.metrics import ServerMetrics
from tokenmill.server.http.errors import APIError, engine_errors
from tokenmill.tokenizer import Tokenizer


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    metrics: ServerMetrics
    allow_special_tokens_in_content: bool = False  # see Tokenizer.apply_chat_template
    started: int = field(default_factory=lambda: int(time.time()))
    async_engine: AsyncEngine = field(init=False)
    _token_strings: dict[int, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.engine.tokenizer is None:
            raise ValueError("the HTTP server needs an engine with a tokenizer (skip_tokenizer_init=False)")
        self.async_engine = AsyncEngine(self.engine)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def check_model(self, name: str, adapters: bool = True, runner: str | None = "generate") -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404
        ``model_not_found`` for a name that is neither (an adapter's name too, unless ``adapters``);
        400 naming ``model`` when the route needs another ``runner`` than the engine's (None: any)."""
        loaded = list(self.engine.lora_adapters()) if adapters and name != self.model_name else []
        if name != self.model_name and name not in loaded:
            served = ", ".join(repr(n) for n in [self.model_name, *loaded])
            message = f"the model {name!r} does not exist; this server serves {served}"
            raise APIError(404, message, param="model", code="model_not_found")
        if runner is not None and runner != self.engine.runner:
            does = "generates" if self.engine.runner == "generate" else "embeds and scores"
            raise APIError(
                400,
                f"the model {self.model_name!r} runs with runner {self.engine.runner!r}: it {does}; this route needs "
                f"a server started with --runner {runner}",
                param="model",
                code="model_not_supported",
            )
        return None if name == self.model_name else name

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text; text that is not valid Unicode, or too long for the context
        whatever its tokens -> 400."""
        check_unicode(texts, "prompt")
        for text in texts:  # a text too long for the context whatever its tokens: refused untokenized
            with engine_errors({}):
                self.engine.check_text_fits(text)
        return await self.async_engine.run_tokenizer(lambda: [self.tokenizer.encode(t) for t in texts])

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        param: str = "messages",
        add_generation_prompt: bool = True,
        counting: bool = False,
    ) -> list[int]:
        """Token ids of ``messages`` through the chat template; invalid Unicode or a template that
        refuses them -> 400 naming ``param`` (the route's name for its messages); messages whose
        text is too long for the context whatever its tokens -> 400 before the template runs.
        ``counting``: for a route that generates nothing (the counting pool, not the tokenizer's)."""
        check_unicode(messages, param)
        check_unicode(tools, "tools")
        with engine_errors({}):
            self.engine.check_text_fits("".join(_message_texts(messages)))
        try:
            special, tokenizer = self.allow_special_tokens_in_content, self.tokenizer
            run = self.async_engine.run_counting if counting else self.async_engine.run_tokenizer
            return await run(lambda: tokenizer.apply_chat_template(messages, add_generation_prompt, tools, special))
        except (ValueError, jinja2.TemplateError) as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param=param) from exc

    async def token_strings(self, ids: list[int]) -> dict[int, str]:
        """Each id decoded on its own (special tokens kept), memoized."""
        missing = [t for t in set(ids) if t not in self._token_strings]
        if missing:
            decode = self.tokenizer.decode
            texts = await self.async_engine.run_tokenizer(
                lambda: [decode([t], skip_special_tokens=False) for t in missing]
            )
            self._token_strings.update(zip(missing, texts))
        return {t: self._token_strings[t] for t in ids}


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The text contents of chat ``messages`` (strings, and the ``text`` of content parts)."""
    texts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return texts


def check_unicode(value: Any, param: str) -> None:
    """Raise APIError(400) if a string in ``value`` (nested lists and dicts too) has a lone surrogate.

    JSON can carry lone surrogates (``"\\ud800"``); they are not Unicode text, and the tokenizer
    cannot encode them. The walk is iterative: request bodies may nest deeply.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(
                    400,
                    f"{param} contains a lone surrogate ({exc.object[exc.start]!r}), which is not valid Unicode text",
                    param=param,
                ) from exc
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the ServerState of the app serving ``request`` (a coroutine, so FastAPI
    calls it on the event loop: a plain function would cost every request a hop through its thread
    pool, which a burst of requests grows to 40 threads)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(get_state)]
"""Type of a route parameter that receives the app's ServerState."""
