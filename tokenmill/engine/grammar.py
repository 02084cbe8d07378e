"""Structured output on xgrammar: grammars compiled for the engine's tokenizer, and per-sequence matchers.

:class:`GrammarCompiler` turns a request's :class:`~tokenmill.request.StructuredOutputsParams` into
a compiled grammar for the caller's thread (intake, never the engine thread), within a time limit,
through a cache of compiled grammars (keyed by the spec, bounded in bytes, least recently used
dropped first). At most :data:`MAX_CONCURRENT_COMPILES` compiles of one engine run at once, each in
a child process (``grammar_compile_worker``) that is killed when the compile outlives its timeout,
freeing its slot at once; a request that waits the whole timeout for a slot gets
:class:`EngineOverloadedError`. Each sequence then gets its own :class:`SequenceGrammar`; only the
engine thread touches it.

Invariant of a :class:`SequenceGrammar`: its matcher has accepted exactly the sequence's output
tokens, and ``bitmask`` holds the tokens allowed next (the model's EOS ids only where the grammar
may end). Preemption keeps output tokens, so a preempted sequence's matcher stays valid.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from tokenmill.engine.grammar_compile_worker import WORKERS, CompileFailed, CompileTimeout, GrammarSource
from tokenmill.engine.overload import EngineOverloadedError
from tokenmill.request import ParameterError, StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar is imported where a grammar is first used (it takes a second to import)
    import xgrammar as xgr

PARAM = "structured_outputs"
MAX_CONCURRENT_COMPILES = 2
"""Grammar compiles running at once, per engine (a compile cache hit takes a slot only briefly)."""
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


MATCH_BUDGET_S = 0.05
"""The most CPU time one token's matching (accept it, compute the next mask) may take: a grammar whose cost
grows with its output (a nested quantifier such as ``(a*)*b`` fed "a" after "a") would otherwise
slow every step of the engine, whose thread does this work."""


class GrammarBudgetError(RuntimeError):
    """A sequence's grammar took longer than :data:`MATCH_BUDGET_S` to match one token."""


class SequenceGrammar:
    """The grammar state of one sequence: a matcher plus the bitmask of the tokens allowed next."""

    def __init__(self, compiled: xgr.CompiledGrammar, non_stop_bits: torch.Tensor) -> None:
        """``non_stop_bits``: a bitmask (int32 ``[1, words]``) with every bit set but the stop tokens'."""
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._non_stop_bits = non_stop_bits
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self.finished = False
        self._fill()

    def advance(self, token: int) -> None:
        """Accept the sequence's next output token; ``finished`` then says whether the grammar is
        done (a stop token accepted, or nothing but a stop token allowed next). Raises RuntimeError
        for a token the bitmask did not allow, :class:`GrammarBudgetError` when matching it took
        longer than :data:`MATCH_BUDGET_S` (the sequence should end: its next tokens cost more)."""
        started = time.thread_time()  # CPU time: a descheduled engine thread does not count
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token}, which its mask did not allow")
        if self._matcher.is_terminated():
            self.finished = True
        else:
            self._fill()
        took = time.thread_time() - started
        if took > MATCH_BUDGET_S:
            raise GrammarBudgetError(
                f"structured output: matching one token took {1000 * took:.0f} ms (limit {1000 * MATCH_BUDGET_S:.0f} "
                "ms) and grows with the output; simplify the constraint (nested quantifiers such as (a*)*)"
            )

    def accepted_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar would accept next (a speculative proposal
        checked before it is verified); the matcher's state is left as it was."""
        accepted = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def _fill(self) -> None:
        self._matcher.fill_next_token_bitmask(self.bitmask)
        # only a completed grammar allows a stop token, so only then may nothing else be allowed
        self.finished = self._matcher.is_completed() and not bool((self.bitmask & self._non_stop_bits).any())


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], grammars: list[SequenceGrammar]) -> None:
    """Set to ``-inf``, in place, every token of ``logits[rows[i]]`` that ``grammars[i]`` does not
    allow (a NaN stays NaN); other rows and allowed tokens keep their values.

    Each bitmask byte (bit ``j`` of int32 word ``w`` is token ``32 w + j``; little-endian bytes)
    looks up its 8 caps, ``+inf`` where allowed and ``-inf`` where not, and each logit becomes the
    smaller of itself and its cap: one table lookup and one elementwise pass (several times faster
    on CPU than xgrammar's own kernel or a boolean ``masked_fill``)."""
    bitmask = torch.cat([g.bitmask for g in grammars]).to(logits.device, non_blocking=True)
    table = _byte_caps(logits.device, logits.dtype)
    caps = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table)
    caps = caps.view(len(rows), -1)[:, : logits.shape[-1]]
    if rows == list(range(logits.shape[0])):
        torch.minimum(logits, caps, out=logits)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = torch.minimum(logits[index], caps)


@functools.cache
def _byte_caps(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: row ``b`` holds ``+inf`` at bit positions set in byte ``b``, ``-inf`` elsewhere."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), float("inf"), float("-inf")).to(device, dtype)


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer; thread-safe, any thread but the engine's.

    ``vocab_size`` is the model's (the logits' width); ``stop_token_ids`` the engine's EOS ids, the
    only tokens that end a grammar. xgrammar's tokenizer tables are built on first use. Compiled
    grammars are kept by source, least recently used dropped first past ``cache_bytes`` (their
    serialized size); a hit takes no compile slot.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: set[int],
        timeout: float,
        cache_bytes: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._timeout = timeout
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._tokenizer_info: xgr.TokenizerInfo | None = None
        self._tokenizer_json = ""
        self._tokenizer_key = ""
        self._non_stop_bits: torch.Tensor | None = None
        self._cache: OrderedDict[GrammarSource, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._cached_bytes = 0
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT_COMPILES)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of a validated spec; ParameterError("structured_outputs") when it
        does not compile, takes longer than the timeout once it has a compile slot (the compile is
        killed), or matches only the empty output or no output at all; EngineOverloadedError when
        no compile slot frees within the timeout."""
        self._load_tokenizer_info()
        source = grammar_source(spec)
        compiled = self._cached(source)
        if compiled is None:
            compiled = self._compile_in_worker(source, spec.kind)
        start = self.new_sequence_grammar(compiled)
        if start.finished:
            raise ParameterError(PARAM, f"{spec.kind} matches only the empty output")
        if not bool(start.bitmask.any()):
            raise ParameterError(PARAM, f"{spec.kind} matches no output at all (no token can start it)")
        return compiled

    def new_sequence_grammar(self, compiled: xgr.CompiledGrammar) -> SequenceGrammar:
        """A fresh matcher of ``compiled`` (from :meth:`compile`) for one sequence."""
        assert self._non_stop_bits is not None, "compile() comes first"
        return SequenceGrammar(compiled, self._non_stop_bits)

    def _compile_in_worker(self, source: GrammarSource, kind: str) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        if not self._slots.acquire(timeout=self._timeout):
            raise EngineOverloadedError(
                f"all {MAX_CONCURRENT_COMPILES} grammar-compile slots stayed busy for {self._timeout:g}s; retry later"
            )
        try:
            worker = WORKERS.acquire()
            try:
                serialized = worker.compile(self._tokenizer_key, self._tokenizer_json, source, self._timeout)
            finally:
                WORKERS.release(worker)
        except CompileTimeout:
            raise ParameterError(PARAM, f"{kind} took longer than {self._timeout:g}s to compile; simplify it") from None
        except CompileFailed as exc:
            raise ParameterError(PARAM, f"{kind} is invalid: {xgrammar_message(exc)}") from None
        finally:
            self._slots.release()
        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info)
        self._remember(source, compiled, len(serialized))
        return compiled

    def _cached(self, source: GrammarSource) -> xgr.CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(source)
            if hit is None:
                return None
            self._cache.move_to_end(source)
            return hit[0]

    def _remember(self, source: GrammarSource, compiled: xgr.CompiledGrammar, nbytes: int) -> None:
        with self._lock:
            if source in self._cache or nbytes > self._cache_bytes:
                return
            self._cache[source] = (compiled, nbytes)
            self._cached_bytes += nbytes
            while self._cached_bytes > self._cache_bytes:
                _, (_, dropped) = self._cache.popitem(last=False)
                self._cached_bytes -= dropped

    def _load_tokenizer_info(self) -> None:
        import xgrammar as xgr

        with self._lock:
            if self._tokenizer_info is not None:
                return
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._tokenizer_json = info.serialize_json()
            self._tokenizer_key = hashlib.sha256(self._tokenizer_json.encode()).hexdigest()
            non_stop = torch.ones(self._vocab_size, dtype=torch.bool)
            non_stop[self._stop_token_ids] = False
            self._non_stop_bits = _pack_bits(non_stop)
            self._tokenizer_info = info


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error message for a client: without its log prefix (time, source file and line,
    failed check), at most 500 characters."""
    return _XGRAMMAR_LOG_PREFIX.sub("", str(exc)).strip()[:500]


def grammar_source(spec: StructuredOutputsParams) -> GrammarSource:
    """What xgrammar compiles for ``spec``; JSON is compact (no free whitespace: a model cannot pad it forever)."""
    kind = spec.kind
    if kind == "json":
        return GrammarSource("json_schema", spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
    if kind == "json_object":
        return GrammarSource("json_object", "")
    if kind == "regex":
        return GrammarSource("regex", spec.regex or "")
    if kind == "choice":  # EBNF string literals: JSON's escapes are the dialect's (a regex escape is not)
        literals = (json.dumps(choice, ensure_ascii=False) for choice in spec.choice or ())
        return GrammarSource("ebnf", "root ::= " + " | ".join(literals))
    grammar = spec.grammar or ""
    return GrammarSource("ebnf" if "::=" in grammar else "lark", grammar)


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's bitmask layout of a bool ``[V]``: bit ``i % 32`` of int32 word ``i // 32``, as ``[1, words]``."""
    words = (allowed.shape[0] + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: allowed.shape[0]] = allowed.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)[None, :]
