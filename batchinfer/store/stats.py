"""Scrape-time figures for /metrics, cheap by construction.

Jobs grouped by status read the jobs table only (request figures come from the jobs' incremental
counters, never COUNT over requests); open shards are counted through the (status, model, ...) index.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction
from batchinfer.store.models import SHARD_OPEN_STATUSES, Job, Shard


@dataclass(frozen=True, slots=True)
class JobStatusTotals:
    """The jobs of one status and the sums of their request counters."""

    status: str
    jobs: int
    total_requests: int
    completed_requests: int
    failed_requests: int


def job_totals_by_status(session: Session) -> list[JobStatusTotals]:
    """One row per job status present: its job count and summed request counters."""
    rows = session.execute(
        select(Job.status, func.count(), func.sum(Job.total_requests), func.sum(Job.completed_requests),
               func.sum(Job.failed_requests)).group_by(Job.status)).all()
    end_transaction(session)
    return [JobStatusTotals(status, count, total or 0, completed or 0, failed or 0)
            for status, count, total, completed, failed in rows]


def open_shards_by_model(session: Session) -> list[tuple[str, str, int]]:
    """(status, model, count) of the shards still available or running."""
    rows = session.execute(
        select(Shard.status, Shard.model, func.count())
        .where(Shard.status.in_(sorted(SHARD_OPEN_STATUSES))).group_by(Shard.status, Shard.model)).all()
    end_transaction(session)
    return [(status, model, count) for status, model, count in rows]
