"""The ingest lease: a submit holds its `validating` job by a lease that a thread extends while it ingests.

A submit that dies mid-ingest (kill -9, a crashed API process, a lost host) stops extending it. The rescuer
(shards.rescue_expired, which every deployment shape runs periodically, see workers.duties) then fails the
job with INGEST_LOST, drops the rows it had written and releases its idempotency key: a retry with the same
key makes a new job instead of returning one that would never leave `validating`. A retry on the host of a
submit whose process is gone does not wait for the lease: it fails the old job at once (`owner_gone`).

Fencing: `Job.ingest_owner` (host:pid:token) names the lease. The rescuer clears it when it fails the job,
so a submit that was only slow, not dead, finds its lease gone at its next extension, stops reading and
drops what it wrote (IngestLeaseLost). The functions taking a session run in the caller's transaction.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from batchinfer.store.db import write_transaction
from batchinfer.store.models import Job, JobStatus, Request, utcnow
from batchinfer.store.quotas import charge_storage
from batchinfer.store.transitions import lock_job

INGEST_LOST = "ingest_lost"  # the error code of a job whose submit died mid-ingest
logger = logging.getLogger("batchinfer.store")


class IngestLeaseLost(RuntimeError):
    """The rescuer failed this job while it was still being ingested (its lease had expired)."""


def _this_host() -> str:
    """The hostname, with the pid namespace when there is one: two containers may share a hostname, but a
    pid means one process only within its namespace."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()}/{namespace}"


def new_ingest_owner() -> str:
    """A lease name unique to this submit: host (and pid namespace), pid and a random token."""
    return f"{_this_host()}:{os.getpid()}:{secrets.token_hex(4)}"


def owner_gone(owner: str | None) -> bool:
    """True when the lease's submit ran on this host and its process has exited (or is a zombie)."""
    host, _, rest = (owner or "").rpartition(":")[0].rpartition(":")
    if host != _this_host() or not rest.isdigit() or int(rest) == os.getpid():
        return False
    pid = int(rest)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    try:  # a killed child its parent has not reaped yet still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def extend_ingest_lease(engine: Engine, *, job_id: int, owner: str, lease_seconds: float,
                        now: datetime | None = None) -> bool:
    """Push the lease's end `lease_seconds` ahead; False when the lease is no longer `owner`'s."""
    expires = (now or utcnow()) + timedelta(seconds=lease_seconds)
    with engine.begin() as connection:
        result = connection.execute(update(Job).where(Job.id == job_id, Job.ingest_owner == owner)
                                    .values(ingest_lease_expires_at=expires))
    return result.rowcount == 1


class IngestLease:
    """Keeps a job's ingest lease alive from a background thread while the `with` block ingests.

    The thread extends the lease when it starts, then every quarter lease (on its own connection, so a long
    chunk insert does not delay it). The first extension is at once because the job's first expiry was set
    before its row was committed: a commit that waited (a quota lock, a slow disk) used up part of the lease.
    `check()` raises IngestLeaseLost once an extension found the lease taken by the rescuer.
    """

    def __init__(self, engine: Engine, *, job_id: int, owner: str, lease_seconds: float) -> None:
        self.engine, self.job_id, self.owner, self.lease_seconds = engine, job_id, owner, lease_seconds
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ingest-lease-{job_id}", daemon=True)

    @classmethod
    def of_session(cls, session: Session, *, job_id: int, owner: str, lease_seconds: float) -> IngestLease:
        """The lease, extended on the engine of `session`."""
        bind = session.get_bind()
        engine = bind if isinstance(bind, Engine) else bind.engine
        return cls(engine, job_id=job_id, owner=owner, lease_seconds=lease_seconds)

    def __enter__(self) -> IngestLease:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def check(self) -> None:
        """Raise IngestLeaseLost if the rescuer has failed the job (stop ingesting, drop what was written)."""
        if self.lost.is_set():
            raise IngestLeaseLost(f"job {self.job_id}: the ingest lease expired and the job was failed")

    def _run(self) -> None:
        wait = 0.0  # the first extension at once
        while not self._stop.wait(wait):
            wait = self.lease_seconds / 4
            try:
                extended = extend_ingest_lease(self.engine, job_id=self.job_id, owner=self.owner,
                                               lease_seconds=self.lease_seconds)
            except SQLAlchemyError as exc:  # the database is away for a moment: try again next time
                logger.warning("job %s: could not extend the ingest lease (%s)", self.job_id, exc)
                continue
            if not extended:
                self.lost.set()
                return


def lost_ingest_message(owner: str, *, died: bool) -> str:
    """The error a job gets when its submit died mid-ingest: what happened and what to do."""
    what = "exited" if died else "stopped renewing its ingest lease (killed, or cut off from the database)"
    return (f"ingest stopped: the submit reading the input file ({owner}) {what} before the file was fully "
            "read, so no request of this batch ran. Submit the file again; a retry with the same "
            "idempotency key creates a new batch.")


def fail_lost_ingests(session: Session, *, now: datetime | None = None,
                      job_id: int | None = None) -> list[int]:
    """In the caller's write transaction: fail `validating` jobs whose ingest lease expired; returns ids.

    With `job_id`, only that job, and also when its lease is still running but its submit's process is
    gone (a retry on the same host). The failed job keeps no request rows, loses its idempotency key (a
    retry makes a new job) and carries one INGEST_LOST error saying what happened and what to do.
    """
    now = now or utcnow()
    query = select(Job.id).where(Job.status == JobStatus.VALIDATING, Job.ingest_owner.is_not(None))
    query = query.where(Job.id == job_id) if job_id is not None else query.where(
        Job.ingest_lease_expires_at < now)
    failed = []
    for candidate in session.scalars(query.order_by(Job.id)).all():
        job = lock_job(session, candidate)
        if job.status != JobStatus.VALIDATING or job.ingest_owner is None:
            continue
        expired = job.ingest_lease_expires_at is None or job.ingest_lease_expires_at < now
        died = owner_gone(job.ingest_owner)
        if not (expired or died):
            continue
        session.execute(delete(Request).where(Request.job_id == job.id))
        charge_storage(session, owner=job.owner, delta=-job.request_bytes)  # the owner's bytes again
        job.request_bytes = 0
        message = lost_ingest_message(job.ingest_owner, died=died)
        job.errors = [{"code": INGEST_LOST, "message": message, "line": None, "param": None}]
        job.num_errors, job.status, job.failed_at = 1, JobStatus.FAILED, now
        job.idempotency_key, job.ingest_owner, job.ingest_lease_expires_at = None, None, None
        failed.append(job.id)
        logger.warning("job %s failed: %s", job.id, message)
    return failed


def release_lost_ingest(session: Session, *, job: Job) -> bool:
    """Before a retry returns `job` for its idempotency key: fail it if its submit died; True if it did."""
    if job.status != JobStatus.VALIDATING:
        return False
    with write_transaction(session):
        return bool(fail_lost_ingests(session, job_id=job.id))
