"""When a job's work happened: the first claim of its shards, and its generated tokens over time.

The first claim is when throughput starts to be measured: the time a job waited for a free worker (or for
the model to load) is not throughput, so an ETA measured from `in_progress_at` would be off by all of it.
Both reads are cheap by construction: the first claim is a MIN over the job's shards through the
(job_id, status) index; the timeline is one GROUP BY over the job's primary-key range, for a chart.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from batchinfer.store.columns import utcnow
from batchinfer.store.db import end_transaction, is_sqlite
from batchinfer.store.models import Job, Request, Shard, request_id_for

SQLITE_UNIX_EPOCH_JULIAN_DAY = 2440587.5


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """Tokens generated per second by the requests that finished in one time bucket."""

    start: float  # unix seconds
    end: float  # unix seconds: start + the bucket's width, or now for a running job's last bucket
    tokens_per_second: float
    requests: int  # requests finished in the bucket


def first_claims(session: Session, *, job_ids: Collection[int]) -> dict[int, datetime]:
    """job id -> when a worker first claimed one of its shards (jobs never claimed are absent)."""
    if not job_ids:
        return {}
    rows = session.execute(select(Shard.job_id, func.min(Shard.started_at))
                           .where(Shard.job_id.in_(sorted(job_ids)), Shard.started_at.is_not(None))
                           .group_by(Shard.job_id)).all()
    end_transaction(session)
    # MIN keeps the column type: aware UTC (never NULL: the WHERE above)
    return {job_id: started for job_id, started in rows if started is not None}


def first_claim(session: Session, *, job_id: int) -> datetime | None:
    """When a worker first claimed one of the job's shards, or None."""
    return first_claims(session, job_ids=[job_id]).get(job_id)


def job_end(job: Job) -> datetime | None:
    """When the job stopped running (finalizing, or its terminal timestamp), or None while it runs."""
    return job.finalizing_at or job.completed_at or job.cancelled_at or job.expired_at or job.failed_at


def token_timeline(session: Session, *, job: Job, points: int = 60,
                   now: datetime | None = None) -> list[TimelinePoint]:
    """The job's generated tokens per second over time, in at most `points` equal buckets.

    Measured from the first claim to the job's end (or now); a request counts in the bucket in which it
    finished. The last bucket of a running job is divided by the part of it that has passed.
    """
    start = first_claim(session, job_id=job.id)
    if start is None:
        return []
    end = job_end(job) or now or utcnow()
    span = max((end - start).total_seconds(), 1.0)
    width = float(max(1, math.ceil(span / max(points, 1))))
    t0 = start.timestamp()
    finished_epoch = _epoch_seconds(session)
    offset = (finished_epoch - t0) / width
    bucket = cast(offset, Integer) if is_sqlite(session) else func.floor(offset)  # SQLite: truncates
    rows = session.execute(
        select(bucket, func.coalesce(func.sum(Request.completion_tokens), 0), func.count())
        .where(Request.id > request_id_for(job.id, 0), Request.id < request_id_for(job.id + 1, 0),
               Request.finished_at >= start)
        .group_by(bucket)).all()
    end_transaction(session)
    buckets = max(1, math.ceil(span / width))
    tokens: dict[int, tuple[int, int]] = {}
    for index, total, count in rows:
        key = min(int(index), buckets - 1)  # a request finished at the very end lands in the last bucket
        seen_total, seen_count = tokens.get(key, (0, 0))
        tokens[key] = (seen_total + int(total), seen_count + int(count))
    out = []
    for index in range(buckets):
        bucket_start = t0 + index * width
        bucket_end = min(bucket_start + width, max(end.timestamp(), bucket_start + 1e-6))
        total, count = tokens.get(index, (0, 0))
        out.append(TimelinePoint(start=bucket_start, end=bucket_end, requests=count,
                                 tokens_per_second=round(total / (bucket_end - bucket_start), 2)))
    return out


def _epoch_seconds(session: Session):  # noqa: ANN202 - a SQL expression
    """Request.finished_at as unix seconds, in the database's own dialect."""
    if is_sqlite(session):  # stored as naive UTC text: julianday reads it
        return (func.julianday(Request.finished_at) - SQLITE_UNIX_EPOCH_JULIAN_DAY) * 86400.0
    return func.extract("epoch", Request.finished_at)
