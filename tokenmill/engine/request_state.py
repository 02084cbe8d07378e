"""RequestState: the engine's state of one request (its ``n`` sequences, detokenizers and what was
sent), and the one place request ids are minted.

Made by :class:`~tokenmill.engine.intake.Intake` on the caller's thread; from submission on, only
the engine thread writes it (the request table claims and frees its id and waiting place).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.sequence import Sequence
from tokenmill.request import OutputCallback, RequestMetrics, SamplingParams


def new_request_id() -> str:
    """A fresh request id (``req-`` and 16 hex digits) for a request the caller did not name."""
    return f"req-{uuid.uuid4().hex[:16]}"


@dataclass(eq=False)
class RequestState:
    """Engine-side state of one request and its ``n`` sequences (their ``group``: a
    :class:`~tokenmill.engine.sequence.RequestGroup`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    callback: OutputCallback
    metrics: RequestMetrics
    token_limit: int  # prompt + max_tokens, as validated: no sequence grows past it
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)  # empty without a tokenizer
    emitted_tokens: list[int] = field(default_factory=list)  # per sequence: tokens already sent
    final_sent: list[bool] = field(default_factory=list)  # per sequence: its last delta was sent
    prompt_logprobs_sent: bool = False  # they go out once, with the first delta after they are complete
    submitted: bool = False  # set once by the request table: a state runs at most once
    waiting: bool = False  # submitted, not yet scheduled nor finished: counts against max_waiting_requests
    call_id: str = ""  # the call it came in (one API request's prompts, one LLM.generate): admission shares by call
    lora_name: str | None = None  # the LoRA adapter its sequences use (None: the base model)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
