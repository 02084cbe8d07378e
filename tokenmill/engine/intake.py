"""Intake: a prompt and its SamplingParams (or PoolingParams), validated into a RequestState
(caller's thread).

``Intake.make`` tokenizes a text prompt once, validates every parameter against the engine's
limits and the prompt against the context limit (the model's, the engine's and the KV cache's
capacity), and returns the state that is then submitted as is. A text whose UTF-8 length alone
proves it cannot fit is refused before it is tokenized. A refusal raises
:class:`~tokenmill.request.ParameterError` naming the parameter; nothing is allocated before
that, and nothing touches the engine's loop, scheduler or cache. A pooling request is one
sequence that generates nothing: its prompt must be non-empty and fit the context limit itself.
"""

from __future__ import annotations

import copy

import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.grammar import GrammarCompiler
from tokenmill.engine.prompt_size import bytes_per_token_bound, min_tokens
from tokenmill.engine.request_state import RequestState, new_request_id
from tokenmill.engine.sequence import Sequence
from tokenmill.request import (
    INT63,
    ContextLengthError,
    OutputCallback,
    ParameterError,
    PoolingParams,
    RequestLimits,
    RequestMetrics,
    SamplingParams,
    now,
)
from tokenmill.tokenizer import Tokenizer

SIBLING_SEED_STRIDE = 7919
"""Sequence ``i`` of a seeded request samples with ``seed + i * stride``: distinct, reproducible."""


class Intake:
    """Validates requests for one engine; stateless after construction, so any thread may call it."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        limits: RequestLimits,
        context_limit: int,
        device: torch.device,
        grammars: GrammarCompiler | None = None,
        hidden_size: int | None = None,
    ) -> None:
        """``context_limit``: most tokens (prompt + output) one sequence may hold; ``grammars``
        compiles ``structured_outputs`` (None: refused, e.g. without a tokenizer); ``hidden_size``:
        the model's, which bounds a pooling request's ``dimensions`` (None: pooling refused)."""
        self.hidden_size = hidden_size
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.limits = limits
        self.context_limit = context_limit
        self.device = device
        self.bytes_per_token = bytes_per_token_bound(tokenizer) if tokenizer is not None else None

    def make(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        callback: OutputCallback,
        request_id: str | None,
        call_id: str | None = None,
    ) -> RequestState:
        """The validated state of a request (of the call ``call_id``; None: a call of its own);
        raises ParameterError (a ValueError) for bad input. The state keeps its own copy of
        ``params``: changing the caller's object later changes nothing."""
        if isinstance(params, PoolingParams):
            return self._pooling(prompt, params, callback, request_id, call_id)
        if not isinstance(params, SamplingParams):
            raise ParameterError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
        params = copy.deepcopy(params)
        params.validate(self.limits)
        if isinstance(prompt, str):
            self.check_text_fits(prompt, params.max_tokens)
        text, ids = self._tokens(prompt)
        limit = self.context_limit
        max_tokens = params.max_tokens
        if max_tokens is None:  # up to the context limit, or the operator's cap when that is lower
            max_tokens = max(1, min(limit - len(ids), self.limits.max_tokens_cap or limit))
        if len(ids) + max_tokens > limit:
            if params.max_tokens is None:  # no max_tokens given: the prompt leaves no room for one token
                raise ContextLengthError(
                    f"({len(ids)} tokens) leaves no room for output in the context limit of {limit} tokens"
                )
            raise ContextLengthError(
                f"({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} exceeds the "
                f"context limit of {limit} tokens"
            )
        if self.tokenizer is None and params.stop_strings:
            raise ParameterError("stop", "strings need a tokenizer; use stop_token_ids")
        compiled = None
        if params.structured_outputs is not None:  # last: the costliest check, on the caller's thread
            if self.grammars is None:
                raise ParameterError("structured_outputs", "needs a tokenizer")
            compiled = self.grammars.compile(params.structured_outputs)
        rid = request_id or new_request_id()
        metrics, token_limit = RequestMetrics(arrival_time=now()), len(ids) + max_tokens
        state = RequestState(rid, text, ids, params, callback, metrics, token_limit, call_id=call_id or rid)
        for i in range(params.n):
            seq = Sequence(prompt_token_ids=ids, params=params, index=i, group=state)
            if params.seed is not None:
                seed = (params.seed + SIBLING_SEED_STRIDE * i) % INT63
                seq.generator = torch.Generator(device=self.device).manual_seed(seed)
            if compiled is not None and self.grammars is not None:  # each sibling its own matcher
                seq.grammar = self.grammars.new_sequence_grammar(compiled)
            if i > 0:  # forked from sequence 0 once its prompt is computed (see the scheduler)
                seq.wait_for = state.seqs[0]
            state.seqs.append(seq)
            if self.tokenizer is not None:
                state.detokenizers.append(IncrementalDetokenizer(self.tokenizer, ids, params))
            state.emitted_tokens.append(0)
            state.final_sent.append(False)
        return state

    def _pooling(
        self,
        prompt: str | list[int],
        params: PoolingParams,
        callback: OutputCallback,
        request_id: str | None,
        call_id: str | None,
    ) -> RequestState:
        """A pooling request's state: one sequence, no detokenizer, nothing to generate."""
        if self.hidden_size is None:
            raise ParameterError("pooling_params", "needs the model's hidden size")
        pooling = copy.deepcopy(params)
        pooling.validate(self.hidden_size, self.context_limit)
        keep = pooling.truncate_prompt_tokens
        if isinstance(prompt, str):
            if not prompt:  # refused even where the tokenizer would add a BOS token to it
                raise ParameterError("prompt", "is empty")
            if keep is None:
                self.check_text_fits(prompt, max_tokens=0)
        text, ids = self._tokens(prompt)
        if keep is not None and len(ids) > keep:  # its last tokens, as vLLM truncates
            ids = ids[-keep:]
        if len(ids) > self.context_limit:
            raise ContextLengthError(
                f"({len(ids)} tokens) exceeds the context limit of {self.context_limit} tokens; "
                "truncate_prompt_tokens keeps only its last tokens"
            )
        params = SamplingParams(max_tokens=1)  # what the sequence machinery reads; nothing is sampled
        rid = request_id or new_request_id()
        metrics = RequestMetrics(arrival_time=now())
        state = RequestState(rid, text, ids, params, callback, metrics, len(ids), call_id=call_id or rid)
        state.seqs.append(Sequence(prompt_token_ids=ids, params=params, group=state, pooling=pooling))
        state.emitted_tokens.append(0)
        state.final_sent.append(False)
        return state

    def check_text_fits(self, text: str, max_tokens: int | None = None) -> None:
        """Refuse (ContextLengthError) a text too long for the context limit with ``max_tokens``
        (None: 1; 0 for a prompt that generates nothing) output tokens however it tokenizes, without
        tokenizing it; never refuses a text that fits (see :mod:`~tokenmill.engine.prompt_size`)."""
        if self.bytes_per_token is None:
            return
        least = min_tokens(text, self.bytes_per_token)
        if least + (1 if max_tokens is None else max_tokens) > self.context_limit:
            if max_tokens == 0:
                outcome = "it exceeds"
            elif max_tokens:
                outcome = f"with max_tokens ({max_tokens}) it exceeds"
            else:
                outcome = "it leaves no room for output in"
            raise ContextLengthError(
                f"is at least {least} tokens long ({self.bytes_per_token} bytes of text per token at most), so "
                f"{outcome} the context limit of {self.context_limit} tokens"
            )

    def _tokens(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids, checked against the vocabulary."""
        vocab = self.limits.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParameterError("prompt", "must be token ids: the engine runs without a tokenizer")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ParameterError("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        else:
            raise ParameterError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ParameterError("prompt", "is empty")
        return text, ids
