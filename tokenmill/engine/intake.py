"""Intake: a prompt and its SamplingParams (or PoolingParams), validated into a RequestState
(caller's thread).

``Intake.make`` tokenizes a text prompt once, validates every parameter against the engine's
limits and the prompt against the context limit (the model's, the engine's and the KV cache's
capacity), and returns the state that is then submitted as is. A text whose UTF-8 length alone
proves it cannot fit is refused before it is tokenized. A refusal raises
:class:`~tokenmill.request.ParameterError` naming the parameter; nothing is allocated before
that, and nothing touches the engine's loop, scheduler or cache. A pooling request is one
sequence that generates nothing: its prompt must be non-empty and fit the context limit itself (an
encoder's: also one step's token budget, as it is computed whole); its unset pooling parameters
take the model's defaults (:class:`~tokenmill.model.pooling_config.PoolingConfig`). A scoring
request's :class:`~tokenmill.request.ScorePair` becomes the model's pair encoding (a cross-encoder:
the tokenizer's text pair with its token type ids; a decoder reranker: its scoring template). An
engine takes the requests of its runner only: generation, or pooling.
"""

from __future__ import annotations

import copy

import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.grammar import GrammarCompiler
from tokenmill.engine.prompt_size import bytes_per_token_bound, min_tokens
from tokenmill.engine.request_state import RequestState, new_request_id
from tokenmill.engine.sequence import Sequence
from tokenmill.model.pooling_config import PoolingConfig
from tokenmill.request import (
    INT63,
    ContextLengthError,
    OutputCallback,
    ParameterError,
    PoolingParams,
    RequestLimits,
    RequestMetrics,
    SamplingParams,
    ScorePair,
    now,
)
from tokenmill.tokenizer import Tokenizer

Prompt = str | list[int] | ScorePair
"""What :meth:`Intake.make` takes: a text, token ids, or (scoring) a query-document pair."""

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
        hidden_size: int = 1,
        pooling: PoolingConfig | None = None,
        whole_prompt_limit: int | None = None,
    ) -> None:
        """``context_limit``: most tokens (prompt + output) one sequence may hold; ``grammars``
        compiles ``structured_outputs`` (None: refused, e.g. without a tokenizer); ``hidden_size``:
        the model's, which bounds a pooling request's ``dimensions``; ``pooling``: the model's
        pooling defaults (None: a generating engine, pooling refused; set: generation refused);
        ``whole_prompt_limit``: an encoder's largest input (one step's token budget; None: a decoder)."""
        self.hidden_size = hidden_size
        self.pooling = pooling
        self.whole_prompt_limit = whole_prompt_limit
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.limits = limits
        self.context_limit = context_limit
        self.device = device
        self.bytes_per_token = bytes_per_token_bound(tokenizer) if tokenizer is not None else None

    def make(
        self,
        prompt: Prompt,
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
        if self.pooling is not None:
            raise ParameterError(
                "sampling_params",
                "this engine runs a pooling model (runner 'pooling'): it embeds and scores; generation needs "
                "runner='generate'",
            )
        if isinstance(prompt, ScorePair):
            raise ParameterError("prompt", "a query-document pair is a scoring request's prompt (PoolingParams)")
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
        prompt: Prompt,
        params: PoolingParams,
        callback: OutputCallback,
        request_id: str | None,
        call_id: str | None,
    ) -> RequestState:
        """A pooling request's state: one sequence, no detokenizer, nothing to generate."""
        model = self.pooling
        if model is None:
            raise ParameterError(
                "pooling_params",
                "this engine generates (runner 'generate'); embeddings and scores need runner='pooling'",
            )
        pooling = copy.deepcopy(params)
        pooling.validate(self.hidden_size, self.context_limit)
        if pooling.task == "score":
            if model.scores == "similarity":
                raise ParameterError("task", "this model scores by embedding similarity: score through LLM.score")
            if model.scores == "head" and model.num_labels != 1:
                raise ParameterError("task", f"scoring needs a head of one label; this model's has {model.num_labels}")
            pooling.pooling = "cls" if model.scores == "head" else "last"
        else:
            if model.scores != "similarity":
                raise ParameterError(
                    "task", "this model is a reranker: it scores query-document pairs, it does not embed"
                )
            pooling.pooling = pooling.pooling or model.pooling
            pooling.normalize = model.normalize if pooling.normalize is None else pooling.normalize
        if isinstance(prompt, ScorePair) != (pooling.task == "score"):
            wanted = "a ScorePair (query, document)" if pooling.task == "score" else "a text or token ids"
            raise ParameterError("prompt", f"must be {wanted} for task {pooling.task!r}")
        text, ids, types = self._pooling_tokens(prompt, pooling.truncate_prompt_tokens)
        limit = (
            self.context_limit if self.whole_prompt_limit is None else min(self.context_limit, self.whole_prompt_limit)
        )
        if len(ids) > limit:
            what = "the context limit"
            if limit < self.context_limit:
                what = "one step's token budget (max_num_batched_tokens: an encoder's input runs in one step)"
            raise ContextLengthError(
                f"({len(ids)} tokens) exceeds {what} of {limit} tokens; truncate_prompt_tokens shortens it"
            )
        params = SamplingParams(max_tokens=1)  # what the sequence machinery reads; nothing is sampled
        rid = request_id or new_request_id()
        metrics = RequestMetrics(arrival_time=now())
        state = RequestState(rid, text, ids, params, callback, metrics, len(ids), call_id=call_id or rid)
        seq = Sequence(prompt_token_ids=ids, params=params, group=state, pooling=pooling)
        seq.token_type_ids = types
        seq.whole_prompt = self.whole_prompt_limit is not None
        state.seqs.append(seq)
        state.emitted_tokens.append(0)
        state.final_sent.append(False)
        return state

    def _pooling_tokens(self, prompt: Prompt, keep: int | None) -> tuple[str | None, list[int], list[int] | None]:
        """A pooling prompt's text, token ids and token type ids (None: all 0), cut to ``keep``
        tokens: a decoder's last ones (as vLLM truncates), an encoder's text as its tokenizer cuts
        it (special tokens kept, as sentence-transformers does), an encoder's token ids' first ones."""
        encoder = self.whole_prompt_limit is not None
        pair = prompt if isinstance(prompt, ScorePair) else None
        if pair is not None and not (pair.query and pair.document):
            raise ParameterError("prompt", "a query-document pair needs both texts non-empty")
        text = prompt if isinstance(prompt, str) else None
        if pair is not None and self.pooling is not None and self.pooling.scores == "tokens":
            text, pair = self.pooling.format_score_prompt(pair.query, pair.document, pair.instruction), None
        if text is not None and not text:  # refused even where the tokenizer would add a BOS token to it
            raise ParameterError("prompt", "is empty")
        if keep is None and (text is not None or pair is not None):
            self.check_text_fits(text if pair is None else pair.query + pair.document, max_tokens=0)
        if encoder and (text is not None or pair is not None):
            if self.tokenizer is None:
                raise ParameterError("prompt", "must be token ids: the engine runs without a tokenizer")
            first, second = (text, None) if pair is None else (pair.query, pair.document)
            ids, types = self.tokenizer.encode_segments(first, second, keep)
            return text, ids, types if types and any(types) else None
        _, ids = self._tokens(text if text is not None else prompt)
        if keep is not None and len(ids) > keep:
            ids = ids[:keep] if encoder else ids[-keep:]
        return text, ids, None

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

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
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
