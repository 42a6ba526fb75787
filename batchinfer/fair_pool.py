"""FairPool: worker threads shared by tenants, who take turns; no tenant can hold every thread.

Used where one tenant's slow work would otherwise queue everyone else's behind it: the API's batch
ingests (api/deps.py) and a worker's grammar compilations (engine/sampling/structured.py). Work is queued per
owner; a free thread takes the oldest item of the next owner in turn, and an owner (a non-empty name)
runs on at most all threads but one, so a thread stays free for the others. Work without an owner
("" or None: one tenant, or the operator) is not held back. Pure Python: the engine and the API import it.

The threads are daemons (a pool never shut down does not hang the exit), and at exit the work running
then is waited for (up to `exit_wait_s`) and the queued work cancelled: an ingest is not cut mid-file,
and xgrammar's C++ threads are not torn down under a compilation (that aborts the process).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")
# The queue mixes calls of every result type: its futures are Future[Any] (each caller holds a Future[_T])
_Item = tuple[Future[Any], Callable[..., object], tuple[object, ...], dict[str, object]]


class FairPool:
    """`workers` daemon threads running submitted calls, owners taking turns (module docstring)."""

    def __init__(self, workers: int, *, name: str, exit_wait_s: float | None = None) -> None:
        self.workers = workers
        self.exit_wait_s = exit_wait_s  # how long the exit waits for running work (None: until it ends)
        self.per_owner = max(1, workers - 1)  # threads one named owner may hold
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._pending: dict[str, deque[_Item]] = {}  # owner -> its queue; dict order is the turn order
        self._running: Counter[str] = Counter()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()
        atexit.register(_finish_at_exit, weakref.ref(self))

    def submit(self, owner: str | None, fn: Callable[_P, _T], /,
               *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Queue fn(*args, **kwargs) for `owner`; its Future. RuntimeError once shut down."""
        future: Future[_T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a FairPool that was shut down")
            self._pending.setdefault(owner or "", deque()).append((future, fn, args, kwargs))
            self._ready.notify()
        return future

    def load(self, owner: str | None) -> int:
        """The calls of `owner` queued or running now."""
        with self._lock:
            return len(self._pending.get(owner or "", ())) + self._running[owner or ""]

    def shutdown(self, *, wait: bool = True, cancel_futures: bool = False,
                 timeout: float | None = None) -> None:
        """Take no more work; cancel the queued work (`cancel_futures`) or let the threads finish it; with
        `wait`, wait for the threads (at most `timeout` seconds in all)."""
        with self._lock:
            self._closed = True
            queued = [item for queue in self._pending.values() for item in queue] if cancel_futures else []
            if cancel_futures:
                self._pending.clear()
            self._ready.notify_all()
        for future, *_ in queued:
            future.cancel()
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))

    def _next(self) -> tuple[str, _Item] | None:
        """The next owner in turn under its share, and its oldest item (called under the lock)."""
        for owner in list(self._pending):
            if owner and self._running[owner] >= self.per_owner:
                continue
            queue = self._pending.pop(owner)
            item = queue.popleft()
            if queue:
                self._pending[owner] = queue  # back of the turn order
            self._running[owner] += 1
            return owner, item
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                picked = None
                while (picked := self._next()) is None and not (self._closed and not self._pending):
                    self._ready.wait()
                if picked is None:
                    return
            owner, (future, fn, args, kwargs) = picked
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever holds the future
                    future.set_exception(exc)
            with self._lock:
                self._running[owner] -= 1
                self._ready.notify_all()  # an owner at its share may take a turn again


def _finish_at_exit(pool_ref: weakref.ref[FairPool]) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True, timeout=pool.exit_wait_s)
