"""Output: sampled tokens appended to their sequences, stop rules, finishing, and the deltas
each request's callback receives. Engine thread only.

Stop rules, in order: EOS (unless ``ignore_eos``), a stop token id, a stop string (found by the
incremental detokenizer), a finished grammar (structured output: nothing but EOS may follow),
the request's token limit (``max_tokens``, or the context/KV limit). A pooling sequence samples
nothing: it ends with "stop" and its embedding in the step that completes its prompt.
A finished or failed sequence is removed from the scheduler at once, which frees its KV. A
request leaves the table when its last sequence has finished and its final delta is sent.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from tokenmill.engine import pooler
from tokenmill.engine.grammar import GrammarBudgetError
from tokenmill.engine.request_state import RequestState
from tokenmill.engine.request_table import RequestTable
from tokenmill.engine.sampler import NO_ALLOWED_TOKEN
from tokenmill.engine.sequence import SeqStatus, Sequence
from tokenmill.request import CompletionOutput, FinishReason, RequestOutput, now

logger = logging.getLogger("tokenmill.engine")


class OutputProcessor:
    """Turns sampled tokens into sequence updates and deltas for the requests of ``table``."""

    def __init__(
        self,
        table: RequestTable,
        eos_token_ids: set[int],
        weight_version: Callable[[], int],
        lora_version: Callable[[str], int] | None = None,
        score_token_ids: tuple[int, int] | None = None,
    ) -> None:
        """``weight_version()`` and ``lora_version(adapter name)`` tag each appended token;
        ``score_token_ids``: a decoder reranker's ``(no, yes)`` (see ``pooler.score``)."""
        self.score_token_ids = score_token_ids
        self.table = table
        self.scheduler = table.scheduler
        self.eos_token_ids = eos_token_ids
        self.weight_version = weight_version
        self.lora_version = lora_version

    def cache_prompts(self, seqs: list[Sequence]) -> None:
        """Put the prompts a forward just computed (``seqs``: each parent before its forked children)
        into the prefix cache, before their first sampled token is appended."""
        for seq in seqs:
            self.scheduler.cache.cache_prompt(seq.kv, seq.all_token_ids)

    def abort(self, request_id: str) -> bool:
        """End every unfinished sequence of the request with "abort"; False if it is not live."""
        state = self.table.requests.get(request_id)
        if state is None:
            return False
        for seq in state.seqs:
            if not seq.is_finished:
                self.finish(seq, FinishReason.ABORT.value)
        self.emit(state)
        return True

    def process(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[Any]) -> None:
        """Append each sampled token to its sequence, then emit every touched request. A failure
        here (e.g. in detokenization) fails only the request it belongs to."""
        touched: dict[str, RequestState] = {}
        self.append_all(seqs, token_ids, logprobs, touched)
        self.emit_all(touched)

    def append_all(
        self, seqs: list[Sequence], token_ids: list[int], logprobs: list[Any], touched: dict[str, RequestState]
    ) -> None:
        """:meth:`process`'s first half: append each sampled token to its sequence (a failure fails
        only its request) and add each sequence's request to ``touched`` (by id), not emitting it."""
        for seq, token, token_logprobs in zip(seqs, token_ids, logprobs):
            if seq.is_finished:  # a sibling's failure already ended it
                continue
            try:
                self.append(seq, token, token_logprobs)
                touched[seq.group.request_id] = seq.group
            except GrammarBudgetError as exc:  # the token is in; the sequence ends here
                self.fail([seq], str(exc))
            except Exception as exc:
                logger.error("finishing a token failed:\n%s", traceback.format_exc())
                self.fail([seq], f"internal error after sampling: {type(exc).__name__}: {exc}")

    def emit_all(self, touched: dict[str, RequestState]) -> None:
        """:meth:`process`'s second half: emit each of ``touched`` that the table still holds (one
        failed meanwhile has had its final delta); an emit that fails fails only its request."""
        for state in touched.values():
            if state.request_id not in self.table.requests:
                continue
            try:
                self.emit(state)
            except Exception as exc:
                logger.error("emitting output failed:\n%s", traceback.format_exc())
                self.fail(state.seqs, f"internal error while emitting output: {type(exc).__name__}: {exc}")

    def finish_pooled(self, seqs: list[Sequence]) -> None:
        """End each pooling sequence whose prompt is complete with its embedding (or score) and emit
        its request; a failure here fails only that request."""
        for seq in seqs:
            if seq.is_finished:
                continue
            try:
                assert seq.pooling is not None
                if seq.pooling.task == "score":
                    seq.score = pooler.score(seq, self.score_token_ids)
                else:
                    seq.embedding = pooler.embedding(seq)
                self.finish(seq, FinishReason.STOP.value)
                self.emit(seq.group)
            except Exception as exc:
                logger.error("pooling failed:\n%s", traceback.format_exc())
                self.fail([seq], f"internal error in pooling: {type(exc).__name__}: {exc}")

    def append(self, seq: Sequence, token: int, logprobs: Any) -> None:
        """Add a sampled token (and its logprobs) to ``seq`` and apply the stop rules; a grammar dead
        end (``NO_ALLOWED_TOKEN``) ends it with "stop" and what it produced so far."""
        state = seq.group
        assert state is not None, "a sequence the engine runs belongs to a request"
        if token == NO_ALLOWED_TOKEN:
            self.finish(seq, FinishReason.STOP.value)
            return
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now()
        seq.output_token_ids.append(token)
        seq.weight_versions.append(self.weight_version())
        if seq.lora_name is not None and self.lora_version is not None:
            seq.lora_versions.append(self.lora_version(seq.lora_name))
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        if seq.grammar is not None:  # the matcher accepts exactly the output tokens (preemption keeps them)
            seq.grammar.advance(token)
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            self.finish(seq, FinishReason.STOP.value)
            return
        if token in seq.stop_token_ids:
            self.finish(seq, FinishReason.STOP.value, stop_reason=token)
            return
        detok = state.detokenizers[seq.index] if state.detokenizers else None
        if detok is not None:
            detok.add_token(token)
        if detok is not None and detok.stopped_by is not None:
            self.finish(seq, FinishReason.STOP.value, stop_reason=detok.stopped_by)
        elif seq.grammar is not None and seq.grammar.finished:
            self.finish(seq, FinishReason.STOP.value)
        elif seq.n_tokens >= state.token_limit:  # max_tokens, or the context/KV limit when it is None
            self.finish(seq, FinishReason.LENGTH.value)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, cache: bool = True) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.grammar = None  # releases its matcher
        self.scheduler.remove(seq, cache_pages=cache)

    def fail(self, seqs: list[Sequence], message: str) -> None:
        """End ``seqs`` and their siblings with an error (their KV is not cached); notify their requests."""
        states: dict[str, RequestState] = {}
        for seq in seqs:
            if seq.is_finished:
                continue
            seq.error = message
            try:
                self.finish(seq, FinishReason.ERROR.value, cache=False)
            except Exception:  # never let cleanup of a failed step kill the loop
                logger.exception("cleanup of a failed sequence failed")
            states[seq.group.request_id] = seq.group
        for state in states.values():
            for seq in state.seqs:  # siblings of a failed sequence cannot complete the request either
                if not seq.is_finished:
                    seq.error = message
                    self.finish(seq, FinishReason.ERROR.value, cache=False)
            self.emit(state)

    def close(self, state: RequestState, reason: str, error: str | None) -> None:
        """End a request the loop will never run again (the engine stopped; any thread once the loop
        has ended): its unfinished sequences end with ``reason`` and ``error`` and its final delta is
        sent. Its KV is left as it is: nothing uses the cache after the loop ends."""
        for seq in state.seqs:
            if not seq.is_finished:
                seq.status = SeqStatus.FINISHED
                seq.finish_reason, seq.error = reason, error
                seq.grammar = None
        self.emit(state)

    def emit(self, state: RequestState) -> None:
        """Send the request's new tokens/text since the last emit; drop it once finished."""
        outputs = []
        for seq in state.seqs:
            if state.final_sent[seq.index]:
                continue
            start = state.emitted_tokens[seq.index]
            new_ids = seq.output_token_ids[start:]
            if not new_ids and not seq.is_finished:
                continue
            state.emitted_tokens[seq.index] = len(seq.output_token_ids)
            state.final_sent[seq.index] = seq.is_finished
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=_text_delta(state, seq),
                    token_ids=new_ids,
                    logprobs=seq.output_logprobs[start:] if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    error=seq.error,
                    weight_versions=seq.weight_versions[start:],
                    lora_versions=seq.lora_versions[start:],
                )
            )
        prompt_logprobs = state.seqs[0].prompt_logprobs
        if state.prompt_logprobs_sent or prompt_logprobs is None or state.seqs[0].needs_prompt_logits:
            prompt_logprobs = None
        else:
            state.prompt_logprobs_sent = True
        finished = state.finished
        if finished:
            state.metrics.finished_time = now()
            self.table.remove_finished(state)
        delta = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.seqs[0].kv.n_cached_tokens,
            embedding=state.seqs[0].embedding if finished else None,
            score=state.seqs[0].score if finished else None,
        )
        try:
            state.callback(delta)
        except Exception:
            logger.exception("output callback of request %s failed", state.request_id)


def _text_delta(state: RequestState, seq: Sequence) -> str:
    """New text of ``seq``; none for a failed sequence (its detokenizer may be what failed)."""
    if not state.detokenizers or seq.error is not None:
        return ""
    return state.detokenizers[seq.index].take_delta(seq.is_finished)
