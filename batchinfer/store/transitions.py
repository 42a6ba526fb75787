"""One home for state transitions: the row locks every write takes first, stopping a job, finishing it.

Every writer of a job or shard first re-reads the row under a lock inside its write transaction
(PostgreSQL: `SELECT ... FOR UPDATE`; SQLite: the whole transaction is `BEGIN IMMEDIATE`, see
db.write_transaction), so two transitions of one row never interleave. The functions here run in
the caller's transaction and never commit.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from batchinfer.store.db import is_sqlite
from batchinfer.store.errors import JobNotFound, LeaseLost
from batchinfer.store.ids import is_job_id
from batchinfer.store.models import (
    JOB_FINISHING_STATUSES,
    SHARD_OPEN_STATUSES,
    Job,
    JobStatus,
    Request,
    RequestStatus,
    Shard,
    ShardStatus,
)

# What the error file says for requests that never ran.
NOT_RUN_ERRORS: dict[RequestStatus, tuple[str, str]] = {
    RequestStatus.CANCELED: ("batch_cancelled", "The batch was cancelled before this request ran."),
    RequestStatus.EXPIRED: ("batch_expired",
                            "The batch expired (completion_window) before this request ran."),
}

# A stopping job status -> what its pending requests become, and the job's timestamp column.
_STOPS: dict[JobStatus, tuple[RequestStatus, str]] = {
    JobStatus.CANCELLING: (RequestStatus.CANCELED, "cancelling_at"),
    JobStatus.CANCELLED: (RequestStatus.CANCELED, "cancelled_at"),
    JobStatus.EXPIRED: (RequestStatus.EXPIRED, "expired_at"),
}


def lock_job(session: Session, job_id: int, *, owner: str | None = None) -> Job:
    """The job, re-read and locked for this transaction; JobNotFound if absent (or another owner's)."""
    if not is_job_id(job_id):  # beyond the column's range (store.ids): absent, not a database error
        raise JobNotFound(f"job {job_id} not found")
    query = select(Job).where(Job.id == job_id).execution_options(populate_existing=True)
    if not is_sqlite(session):
        query = query.with_for_update()
    job = session.scalar(query)
    if job is None or (owner is not None and job.owner != owner):
        raise JobNotFound(f"job {job_id} not found")
    return job


def lock_shard(session: Session, shard_id: int, *, lease_token: str) -> Shard:
    """The running shard this lease token holds, re-read and locked; LeaseLost when the token is stale."""
    query = (select(Shard).where(Shard.id == shard_id, Shard.lease_token == lease_token,
                                 Shard.status == ShardStatus.RUNNING)
             .execution_options(populate_existing=True))
    if not is_sqlite(session):
        query = query.with_for_update()
    shard = session.scalar(query)
    if shard is None:
        raise LeaseLost(f"shard {shard_id}: lease token no longer valid (rescued, released or finished)")
    return shard


def stop_pending(session: Session, *, job: Job, status: JobStatus, now: datetime) -> None:
    """Stop what has not run yet: pending requests -> canceled / expired, idle shards -> cancelled.

    `status` is cancelling, cancelled or expired; the job takes it (and its timestamp) unless it has
    it already. Finished results and running shards are left alone: a running shard's worker lets go
    when its heartbeat answers False. The caller holds lock_job and then calls finalize_if_done.
    """
    request_status, stamp = _STOPS[status]
    code, message = NOT_RUN_ERRORS[request_status]
    session.execute(update(Request).where(Request.job_id == job.id, Request.status == RequestStatus.PENDING)
                    .values(status=request_status, error_code=code, error_message=message, finished_at=now))
    session.execute(update(Shard).where(Shard.job_id == job.id, Shard.status == ShardStatus.AVAILABLE)
                    .values(status=ShardStatus.CANCELLED, cancelled_at=now))
    if job.status != status:
        job.status = status
        setattr(job, stamp, now)


def finalize_if_done(session: Session, *, job: Job, now: datetime) -> bool:
    """Move a job with no open shard to its end state (in_progress -> completed, cancelling -> cancelled).

    True if it moved.
    """
    if job.status not in JOB_FINISHING_STATUSES:
        return False
    open_shards = session.scalar(select(func.count()).select_from(Shard).where(
        Shard.job_id == job.id, Shard.status.in_(sorted(SHARD_OPEN_STATUSES))))
    if open_shards:
        return False
    if job.status == JobStatus.CANCELLING:
        job.status, job.cancelled_at = JobStatus.CANCELLED, now
    else:
        # finalizing is momentary here: results already live in the database, nothing left to assemble.
        job.status, job.finalizing_at, job.completed_at = JobStatus.COMPLETED, job.finalizing_at or now, now
    return True
