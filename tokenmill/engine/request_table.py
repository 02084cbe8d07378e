"""RequestTable: the engine's live requests, their ids and the bound on waiting requests.

A request's id is claimed by :meth:`RequestTable.reserve` on the submitting thread (any thread)
and freed when its final delta is sent; between the two no other request may use it. A request
counts against ``max_waiting_requests`` from ``reserve`` until it is first scheduled or ends,
so requests still queued for the loop count too. ``requests`` (the admitted ones) and the
finished/failed counters belong to the engine thread.
"""

from __future__ import annotations

import threading

from tokenmill.engine.request_state import RequestState
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.sequence import Sequence
from tokenmill.request import FinishReason


class RequestTable:
    """Admitted requests by id, plus the id and waiting-place bookkeeping of submitted ones."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.requests: dict[str, RequestState] = {}
        self.finished_requests = 0
        self.failed_requests = 0
        self._live_ids: set[str] = set()  # ids from reserve() until the request's final delta
        self._n_waiting = 0  # requests from reserve() until first scheduled or finished (state.waiting)
        self._ids_lock = threading.Lock()

    def reserve(self, state: RequestState, max_waiting: int) -> bool:
        """Claim ``state``'s request id and a waiting place for it (any thread); False, claiming
        nothing, when ``max_waiting`` requests are waiting already; ValueError if the state was
        submitted before or the id belongs to a request that has not finished."""
        with self._ids_lock:
            if state.submitted:
                raise ValueError(f"request {state.request_id!r} was already submitted")
            if state.request_id in self._live_ids:
                raise ValueError(f"request_id {state.request_id!r} is already in use")
            if self._n_waiting >= max_waiting:
                return False
            state.submitted = state.waiting = True
            self._n_waiting += 1
            self._live_ids.add(state.request_id)
            return True

    def stop_waiting(self, state: RequestState) -> None:
        """The request was scheduled, finished or never queued: its waiting place is free (idempotent)."""
        with self._ids_lock:
            if state.waiting:
                state.waiting = False
                self._n_waiting -= 1

    def release(self, state: RequestState) -> None:
        """Free a reserved request's id and waiting place (it finished, or was never queued)."""
        self.stop_waiting(state)
        with self._ids_lock:
            self._live_ids.discard(state.request_id)

    def mark_scheduled(self, seqs: list[Sequence], time: float) -> None:
        """Note the first scheduling of the requests of ``seqs`` (at ``time``): they stop waiting."""
        for seq in seqs:
            state = seq.group
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = time
                self.stop_waiting(state)

    def admit(self, state: RequestState) -> None:
        """Take a reserved request in and hand its sequences to the scheduler (engine thread)."""
        self.requests[state.request_id] = state
        for seq in state.seqs:
            self.scheduler.add(seq)

    def remove_finished(self, state: RequestState) -> None:
        """Drop a request whose final delta is being sent and count how it ended (engine thread)."""
        self.requests.pop(state.request_id, None)
        self.release(state)
        if any(s.finish_reason == FinishReason.ERROR.value for s in state.seqs):
            self.failed_requests += 1
        else:
            self.finished_requests += 1
