"""LeaseKeeper: keeps a worker's shard leases alive from a thread while its main loop is busy computing.

The runner's loop heartbeats the shards it holds between engine calls (runner.py, _check_leases). One
engine call can outlast a lease: an embeddings line of a long input (a dense forward per input; 123 s
on SmolLM2 at 8k tokens), a long prefill, a slow rank. Without this thread every lease the worker holds
would expire meanwhile, its shards rerun elsewhere and, after max_attempts, fail `worker_lost`, other
tenants' shards included.

The loop publishes the leases it holds at every turn (`publish`). The thread wakes every `interval`
seconds and, only when the loop has not published for that long (it is inside a long call), extends
those leases itself, and marks the worker live in the worker table (its `info`, the loop's to refresh,
is left as it is: the thread reads nothing the loop writes). It never decides anything: a
heartbeat that answers False (job cancelled, lease lost) just stops being extended, and the loop's own
check acts on it at its next turn. The statements are fenced by the lease token, so a snapshot that went
stale (a shard completed or released meanwhile) extends nothing.

A loop silent for longer than MAX_SILENT_S is taken to be hung (longer than any collective's timeout,
distributed.COLLECTIVE_TIMEOUT): the thread lets the leases expire, so the rescuer gives the shards to a
healthy worker.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.orm import Session, sessionmaker

from batchinfer.store import shards as shard_store
from batchinfer.store import workers as worker_store
from batchinfer.store.shards import ShardLease

logger = logging.getLogger("batchinfer.workers")

# A main loop silent this long is hung, not computing: its leases are left to expire (rescue takes over).
MAX_SILENT_S = 15 * 60.0


class LeaseKeeper:
    """Extends the published leases from a daemon thread while the runner's loop is inside a long call."""

    def __init__(self, *, sessions: sessionmaker[Session], worker_id: str, lease_seconds: float,
                 interval_s: float) -> None:
        self.sessions = sessions
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.interval_s = interval_s
        self.extensions = 0  # leases this thread extended (the loop was busy), for tests and logs
        self._lock = threading.Lock()
        self._leases: list[ShardLease] = []
        self._published_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, leases: list[ShardLease]) -> None:
        """The loop's turn: these are the leases it holds now (cheap; called every turn)."""
        with self._lock:
            self._leases = leases
            self._published_at = time.monotonic()

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self.publish([])
        self._thread = threading.Thread(target=self._run, name="batchinfer-lease-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (a heartbeat in progress finishes first)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def _run(self) -> None:
        hung_logged = False
        while not self._stop.wait(self.interval_s):
            with self._lock:
                leases, silent = list(self._leases), time.monotonic() - self._published_at
            if silent < self.interval_s or not leases:
                hung_logged = False
                continue
            if silent > MAX_SILENT_S:
                if not hung_logged:
                    logger.error("the worker loop has been inside one engine call for %.0f s; taken as hung, "
                                 "its %d lease(s) are left to expire", silent, len(leases))
                    hung_logged = True
                continue
            try:
                self._extend(leases)
            except Exception:  # a database outage: the loop's own writes meet it and wait it out
                logger.warning("could not extend the leases of a busy worker; retrying", exc_info=True)

    def _extend(self, leases: list[ShardLease]) -> None:
        kept = []
        for lease in leases:
            with self.sessions() as session:
                if shard_store.heartbeat(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                         lease_seconds=self.lease_seconds):
                    kept.append(lease)
                    self.extensions += 1
        with self.sessions() as session:
            worker_store.worker_heartbeat(session, worker_id=self.worker_id)
        with self._lock:
            if self._leases == leases:  # those answered False are the loop's to act on, not to extend
                self._leases = kept
