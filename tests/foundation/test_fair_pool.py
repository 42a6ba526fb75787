"""FairPool (issue 28 items 2, 3): owners take turns on the threads and a named owner never holds them
all, so one tenant's queue of slow work cannot hold up another's."""

from __future__ import annotations

import threading

import pytest

from batchinfer.fair_pool import FairPool


def test_a_busy_owner_leaves_a_thread_to_the_others_and_owners_take_turns() -> None:
    pool = FairPool(2, name="test-fair")
    release = threading.Event()
    order: list[str] = []
    try:
        slow = [pool.submit("owner:a", lambda i=i: (release.wait(30), order.append(f"a{i}")))
                for i in range(3)]
        quick = pool.submit("owner:b", order.append, "b")
        quick.result(timeout=30)  # before: two threads, first come first served: b waited behind a0, a1
        assert order == ["b"] and not any(f.done() for f in slow)
        release.set()
        for future in slow:
            future.result(timeout=30)
        assert order == ["b", "a0", "a1", "a2"]  # a's own work stays in its order, one thread at a time
    finally:
        release.set()
        pool.shutdown()


def test_turns_alternate_between_owners_with_queued_work() -> None:
    pool = FairPool(1, name="test-turns")
    gate = threading.Event()
    order: list[str] = []
    try:
        first = pool.submit("", gate.wait, 30)  # holds the only thread while the queues fill
        futures = [pool.submit(owner, order.append, f"{owner}{i}") for owner in ("a", "b") for i in range(3)]
        gate.set()
        first.result(timeout=30)
        for future in futures:
            future.result(timeout=30)
        assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    finally:
        gate.set()
        pool.shutdown()


def test_shutdown_cancels_queued_work_refuses_more_and_results_and_errors_come_back() -> None:
    pool = FairPool(1, name="test-shutdown")
    gate, started = threading.Event(), threading.Event()
    running = pool.submit("a", lambda: (started.set(), gate.wait(30))[1])
    assert started.wait(30)
    queued = pool.submit("b", int, "7")
    failing = pool.submit("c", int, "x")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled() and failing.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("a", int, "1")
    gate.set()
    assert running.result(timeout=30) is True
    pool.shutdown(timeout=30)
    other = FairPool(1, name="test-results")
    try:
        assert other.submit("a", int, "7").result(timeout=30) == 7
        with pytest.raises(ValueError):
            other.submit("a", int, "x").result(timeout=30)
    finally:
        other.shutdown()
