"""vLLM's tokenization routes: ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize``: ``{"model", "prompt"}`` or ``{"model", "messages", "tools", "add_generation_prompt"}``
(exactly one of ``prompt`` and ``messages``) -> ``{"tokens", "count", "max_model_len"}``. A prompt
is tokenized as the completions route does (``add_special_tokens`` default true), messages through
the chat template as the chat route does (``add_generation_prompt`` default true; the template
places the special tokens, so ``add_special_tokens`` may only be false). As in vLLM, no context
limit applies: a prompt longer than ``max_model_len`` is counted (the body size limit bounds the work). ``/detokenize``:
``{"model", "tokens"}`` -> ``{"prompt"}``, special tokens kept, so it inverts ``/tokenize``.
``model`` may be left out, as in vLLM; when given it must be the served model. The work runs on
the tokenizer pool; auth and error shapes are those of the OpenAI routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import StrictBool, StrictInt, StrictStr

from tokenmill.server.http.errors import APIError
from tokenmill.server.http.state import State, check_unicode
from tokenmill.server.openai.chat import template_message
from tokenmill.server.openai.protocol import ChatMessage, Tool
from tokenmill.server.shared.request_body import RequestBody

router = APIRouter()


class TokenizeRequest(RequestBody):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None


class DetokenizeRequest(RequestBody):
    model: StrictStr | None = None
    tokens: list[StrictInt]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
    if body.model is not None:
        state.check_model(body.model, runner=None)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is None:
        special = body.add_special_tokens is None or body.add_special_tokens
        text = body.prompt or ""
        check_unicode(text, "prompt")
        tokens = await state.async_engine.run_counting(lambda: state.tokenizer.encode(text, special))
    else:
        if body.add_special_tokens:
            message = "cannot be true with messages: the chat template places the special tokens"
            raise APIError(400, f"add_special_tokens {message}", param="add_special_tokens")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        generation_prompt = body.add_generation_prompt is None or body.add_generation_prompt
        messages = [template_message(m) for m in body.messages]
        tokens = await state.render_chat(messages, tools, add_generation_prompt=generation_prompt, counting=True)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_context_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, str]:
    if body.model is not None:
        state.check_model(body.model, runner=None)
    vocab = state.tokenizer.vocab_size
    outside = [t for t in body.tokens if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"tokens {outside[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    decode = state.tokenizer.decode
    text = await state.async_engine.run_counting(lambda: decode(body.tokens, skip_special_tokens=False))
    return {"prompt": text}
