"""The benchmarks' own-thread runner: the work runs on a thread that ends, its result or its
exception comes back to the caller."""

from __future__ import annotations

import threading

import pytest

from tokenmill.bench.own_thread import on_own_thread


def test_work_runs_on_a_thread_that_ends_and_returns_its_result() -> None:
    threads: list[threading.Thread] = []

    @on_own_thread
    def work(x: int) -> int:
        threads.append(threading.current_thread())
        return x * 2

    assert work(21) == 42
    assert threads[0] is not threading.current_thread() and not threads[0].is_alive()


def test_exceptions_reach_the_caller() -> None:
    @on_own_thread
    def failing() -> None:
        raise KeyError("no such preset")

    with pytest.raises(KeyError, match="no such preset"):
        failing()
