"""Per-owner quotas (README "Security"): stored bytes, jobs not yet finished, requests waiting to run.

One owner (an API key's tenant) must not fill the disk or the queue for the others. Each limit is a
setting (None, set as 0 or "none": no limit); QuotaExceeded names it and the API answers 429. The
checks are reads, made before the work is accepted (a race of concurrent uploads may pass one over the
limit by their own size).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store.db import end_transaction
from batchinfer.store.errors import JobError
from batchinfer.store.models import JOB_LIVE_STATUSES, File, Job


class QuotaExceeded(JobError):
    """An owner is at one of its limits; the message names the setting (the API answers 429)."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def check_storage_quota(session: Session, *, owner: str, settings: Settings, new_bytes: int) -> None:
    """QuotaExceeded if the owner's uploaded files plus `new_bytes` would pass max_owner_stored_bytes."""
    limit = settings.max_owner_stored_bytes
    if limit is None:
        return
    stored = session.scalar(select(func.coalesce(func.sum(File.bytes), 0)).where(File.owner == owner)) or 0
    end_transaction(session)
    if stored + new_bytes > limit:
        raise QuotaExceeded(f"Storage quota exceeded: your files hold {stored} bytes and this upload "
                            f"{new_bytes}; the limit is {limit} bytes (max_owner_stored_bytes). Delete "
                            "files you no longer need.", setting="max_owner_stored_bytes")


def check_job_quotas(session: Session, *, owner: str, settings: Settings) -> None:
    """QuotaExceeded if the owner already has max_owner_active_jobs unfinished jobs, or
    max_owner_pending_requests requests still waiting."""
    active_limit, pending_limit = settings.max_owner_active_jobs, settings.max_owner_pending_requests
    if active_limit is None and pending_limit is None:
        return
    pending = Job.total_requests - Job.completed_requests - Job.failed_requests
    active, waiting = session.execute(
        select(func.count(), func.coalesce(func.sum(pending), 0))
        .where(Job.owner == owner, Job.status.in_(JOB_LIVE_STATUSES))).one()
    end_transaction(session)
    if active_limit is not None and active >= active_limit:
        raise QuotaExceeded(f"Too many active batches: you have {active}, the limit is {active_limit} "
                            "(max_owner_active_jobs). Wait for some to finish or cancel them.",
                            setting="max_owner_active_jobs")
    if pending_limit is not None and waiting >= pending_limit:
        raise QuotaExceeded(f"Too many pending requests: {waiting} of yours are waiting to run, the limit "
                            f"is {pending_limit} (max_owner_pending_requests). Wait for your batches to "
                            "progress.", setting="max_owner_pending_requests")
