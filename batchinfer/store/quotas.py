"""Per-owner quotas (README "Security"): stored bytes, jobs not yet finished, requests waiting to run.

One owner (an API key's tenant) must not fill the disk or the queue for the others. Each limit is a
setting (None, set as 0 or "none": no limit); QuotaExceeded names it and the API answers 429.

The limits are enforced atomically, under a lock on the owner's `owner_usage` row (PostgreSQL:
`SELECT ... FOR UPDATE`; SQLite: the write transaction is `BEGIN IMMEDIATE`):

- creating a job (`reserve_job`, called by submit_job in the transaction that inserts the job row)
  checks the owner's live jobs and waiting requests, counting a `validating` job by its reservation
  (its input's line count) until its ingest has counted its real requests, so concurrent creates see
  each other; it charges the job's request rows (its input's size) to the owner's stored bytes;
- registering an upload (store.files.create_file) checks and charges its size in its insert's
  transaction.

`owner_usage.stored_bytes` is a counter moved with each thing it counts (`charge_storage`): uploads,
the request rows a job copies, its generated output and error files (store.result_files, once when
measured); deleting or purging one of them gives its bytes back. The `check_*` functions are reads for
early answers (an upload refused before its bytes land); the reservation is what holds.
"""

from __future__ import annotations

from sqlalchemy import Insert, case, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store.db import end_transaction, is_sqlite
from batchinfer.store.errors import JobError
from batchinfer.store.models import JOB_LIVE_STATUSES, Job, JobStatus, OwnerUsage


class QuotaExceeded(JobError):
    """An owner is at one of its limits; the message names the setting (the API answers 429)."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def stored_bytes(session: Session, *, owner: str) -> int:
    """The owner's stored bytes counter (0 for an owner that never stored anything)."""
    value = session.scalar(select(OwnerUsage.stored_bytes).where(OwnerUsage.owner == owner)) or 0
    end_transaction(session)
    return int(value)


def lock_owner(session: Session, *, owner: str) -> OwnerUsage:
    """In the caller's write transaction: the owner's usage row, created if missing, locked until commit."""
    row = session.get(OwnerUsage, owner, populate_existing=True,
                      with_for_update=None if is_sqlite(session) else True)
    if row is None:
        if is_sqlite(session):
            statement: Insert = sqlite_insert(OwnerUsage).on_conflict_do_nothing(index_elements=["owner"])
        else:
            statement = pg_insert(OwnerUsage).on_conflict_do_nothing(index_elements=["owner"])
        session.execute(statement.values(owner=owner, stored_bytes=0))
        row = session.get(OwnerUsage, owner, populate_existing=True,
                          with_for_update=None if is_sqlite(session) else True)
    assert row is not None  # inserted above, or by a concurrent writer whose commit we waited for
    return row


def charge_storage(session: Session, *, owner: str, delta: int) -> None:
    """In the caller's write transaction: move the owner's stored bytes by `delta` (never below 0)."""
    if delta == 0:
        return
    if delta > 0:
        lock_owner(session, owner=owner)
    session.execute(update(OwnerUsage).where(OwnerUsage.owner == owner).values(
        stored_bytes=case((OwnerUsage.stored_bytes + delta < 0, 0),
                          else_=OwnerUsage.stored_bytes + delta)))


def _storage_error(stored: int, new_bytes: int, limit: int, what: str) -> QuotaExceeded:
    return QuotaExceeded(f"Storage quota exceeded: you store {stored} bytes (files, batches' requests and "
                         f"results) and {what} {new_bytes}; the limit is {limit} bytes "
                         "(max_owner_stored_bytes). Delete files or batches' output files you no longer "
                         "need.", setting="max_owner_stored_bytes")


def check_storage_quota(session: Session, *, owner: str, settings: Settings, new_bytes: int,
                        what: str = "this upload") -> None:
    """QuotaExceeded if the owner's stored bytes plus `new_bytes` would pass max_owner_stored_bytes."""
    limit = settings.max_owner_stored_bytes
    if limit is None:
        return
    stored = stored_bytes(session, owner=owner)
    if stored + new_bytes > limit:
        raise _storage_error(stored, new_bytes, limit, what)


def charge_upload(session: Session, *, owner: str, size: int, limit: int | None) -> None:
    """In the caller's write transaction: charge an upload's bytes, QuotaExceeded past `limit`."""
    row = lock_owner(session, owner=owner)
    if limit is not None and row.stored_bytes + size > limit:
        raise _storage_error(row.stored_bytes, size, limit, "this upload")
    row.stored_bytes += size


def _waiting_requests(session: Session, owner: str) -> tuple[int, int]:
    """(live jobs, requests waiting) of the owner; a validating job counts at least its reservation."""
    counted = case((Job.status == JobStatus.VALIDATING,
                    case((Job.reserved_requests > Job.total_requests, Job.reserved_requests),
                         else_=Job.total_requests)), else_=Job.total_requests)
    pending = counted - Job.completed_requests - Job.failed_requests
    active, waiting = session.execute(
        select(func.count(), func.coalesce(func.sum(pending), 0))
        .where(Job.owner == owner, Job.status.in_(JOB_LIVE_STATUSES))).one()
    return int(active), int(waiting)


def _check_jobs(active: int, waiting: int, settings: Settings, new_requests: int = 0) -> None:
    active_limit, pending_limit = settings.max_owner_active_jobs, settings.max_owner_pending_requests
    if active_limit is not None and active >= active_limit:
        raise QuotaExceeded(f"Too many active batches: you have {active}, the limit is {active_limit} "
                            "(max_owner_active_jobs). Wait for some to finish or cancel them.",
                            setting="max_owner_active_jobs")
    if pending_limit is not None and (waiting >= pending_limit or waiting + new_requests > pending_limit):
        also = f" and this batch up to {new_requests}" if new_requests else ""
        raise QuotaExceeded(f"Too many pending requests: {waiting} of yours are waiting to run{also}, the "
                            f"limit is {pending_limit} (max_owner_pending_requests). Wait for your batches "
                            "to progress.", setting="max_owner_pending_requests")


def check_job_quotas(session: Session, *, owner: str, settings: Settings) -> None:
    """QuotaExceeded if the owner already has max_owner_active_jobs unfinished jobs, or
    max_owner_pending_requests requests still waiting (a read: reserve_job is what holds)."""
    if settings.max_owner_active_jobs is None and settings.max_owner_pending_requests is None:
        return
    active, waiting = _waiting_requests(session, owner)
    end_transaction(session)
    _check_jobs(active, waiting, settings)


def reserve_job(session: Session, *, job: Job, settings: Settings, requests: int, request_bytes: int) -> None:
    """In the transaction inserting `job` (not added yet): check the owner's job, request and storage
    limits under the owner's lock, hold `requests` for it while it validates and charge `request_bytes`.

    QuotaExceeded naming the setting; then nothing is reserved or charged (the caller rolls back)."""
    usage = lock_owner(session, owner=job.owner)
    if settings.max_owner_active_jobs is not None or settings.max_owner_pending_requests is not None:
        active, waiting = _waiting_requests(session, job.owner)
        _check_jobs(active, waiting, settings, new_requests=requests)
    limit = settings.max_owner_stored_bytes
    if limit is not None and usage.stored_bytes + request_bytes > limit:
        raise _storage_error(usage.stored_bytes, request_bytes, limit, "this batch's requests")
    usage.stored_bytes += request_bytes
    job.reserved_requests, job.request_bytes = requests, request_bytes
