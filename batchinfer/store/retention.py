"""Retention: the purge step that deletes expired files and old finished jobs (README "Security").

What goes, at each pass (`batchinfer purge`, and the `purge` duty of beat / the scheduler):
- an uploaded file whose `expires_at` passed (set from the upload's `expires_after`): row and bytes;
- a finished job (terminal status) whose output expired: `output_expires_after` seconds after it
  ended (the batch's own policy), else `finished_job_retention_seconds` after it ended (the setting,
  30 days by default; 0 or "none": kept). Its request rows, shards and the job row go; batches made
  from a deleted file keep their own rows until then;
- a result-cache body (store/result_cache.py) unused for `finished_job_retention_seconds` that no request
  row references any more (a job's rows pin the bodies its output reads; they go first, in this pass).

Each job is deleted in its own transaction (its requests by primary-key range first, so a million-row
job never holds one huge cascade), so a purge may stop anywhere and the next one finishes the work.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import ColumnElement, delete, func, or_, select
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store.db import end_transaction, rowcount, write_transaction
from batchinfer.store.models import (
    JOB_TERMINAL_STATUSES,
    LINE_BITS,
    File,
    Job,
    Request,
    request_id_for,
    utcnow,
)
from batchinfer.store.quotas import charge_storage
from batchinfer.store.result_cache import purge_unused

PURGE_BATCH = 500  # jobs or files looked at per query


@dataclass
class PurgeReport:
    """What one purge deleted: file ids and job ids."""

    files: list[int] = field(default_factory=list)
    jobs: list[int] = field(default_factory=list)
    result_bodies: int = 0


def purge(session: Session, *, settings: Settings, now: datetime | None = None) -> PurgeReport:
    """Delete expired files and finished jobs past their retention (see the module docstring)."""
    now = now or utcnow()
    report = PurgeReport()
    expired_files = list(session.execute(select(File.id, File.path, File.owner, File.bytes)
                                         .where(File.expires_at <= now).order_by(File.id).limit(PURGE_BATCH)))
    end_transaction(session)
    for file_id, path, owner, size in expired_files:
        with write_transaction(session):
            if rowcount(session.execute(delete(File).where(File.id == file_id))):
                charge_storage(session, owner=owner, delta=-size)  # its bytes are the owner's again
        if path:
            with contextlib.suppress(OSError):
                Path(path).unlink()
        report.files.append(file_id)
    for job_id in _jobs_to_purge(session, settings=settings, now=now):
        with write_transaction(session):
            first, last = request_id_for(job_id, 0), request_id_for(job_id, (1 << LINE_BITS) - 1)
            session.execute(delete(Request).where(Request.id >= first, Request.id <= last))
            held_bytes = (Job.request_bytes + func.coalesce(Job.output_bytes, 0)
                          + func.coalesce(Job.error_bytes, 0))
            held = session.execute(select(Job.owner, held_bytes).where(Job.id == job_id)).first()
            session.execute(delete(Job).where(Job.id == job_id))  # shards cascade; schedule runs keep null
            if held is not None:
                charge_storage(session, owner=held[0], delta=-int(held[1]))
        report.jobs.append(job_id)
    retention = settings.finished_job_retention_seconds
    report.result_bodies = purge_unused(session, older_than_s=retention, now=now)
    return report


def _jobs_to_purge(session: Session, *, settings: Settings, now: datetime) -> list[int]:
    ended = func.coalesce(Job.completed_at, Job.cancelled_at, Job.expired_at, Job.failed_at)
    finished = Job.status.in_(JOB_TERMINAL_STATUSES)
    retention = settings.finished_job_retention_seconds
    conditions: list[ColumnElement[bool]] = [Job.output_expires_after.is_not(None)]
    if retention is not None:
        conditions.append(ended <= now - timedelta(seconds=retention))
    due: list[int] = []
    after = 0
    while True:  # keyset pages: jobs kept longer by their own policy never hide later ones
        rows = session.execute(select(Job.id, ended, Job.output_expires_after)
                               .where(finished, or_(*conditions), Job.id > after)
                               .order_by(Job.id).limit(PURGE_BATCH)).all()
        end_transaction(session)
        for job_id, end, keep_s in rows:
            limit = keep_s if keep_s is not None else retention
            if end is not None and limit is not None and _aware(end, now) + timedelta(seconds=limit) <= now:
                due.append(job_id)
        if len(rows) < PURGE_BATCH:
            return due
        after = rows[-1][0]


def _aware(moment: datetime, now: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=now.tzinfo)
