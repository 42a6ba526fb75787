"""Every status enum of the store and every status set, each defined once (models.py re-exports them).

Status columns hold these StrEnum values; each state has its own timestamp column on its row.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    """Batch status, as in the OpenAI Batch API.

    validating -> in_progress -> finalizing -> completed      (the happy path)
    validating -> failed                                      (unusable file / on_invalid="fail")
    in_progress -> cancelling -> cancelled                    (cancelling while a shard is still running)
    validating | in_progress | cancelling -> expired          (completion_window passed)
    """

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# Each status set is defined here once and imported. StrEnum members hash and compare as their string
# values, so `"completed" in JOB_TERMINAL_STATUSES` holds for the raw strings of the REST API too.
JOB_TERMINAL_STATUSES: frozenset[JobStatus] = frozenset(
    {JobStatus.FAILED, JobStatus.COMPLETED, JobStatus.EXPIRED, JobStatus.CANCELLED})
"""Final: the job's results no longer change (its output and error files can be offered)."""
JOB_LIVE_STATUSES: frozenset[JobStatus] = frozenset(set(JobStatus) - JOB_TERMINAL_STATUSES)
"""Not final yet: what expiry can still stop."""
JOB_CANCELLABLE_STATUSES: frozenset[JobStatus] = frozenset(
    {JobStatus.VALIDATING, JobStatus.IN_PROGRESS, JobStatus.FINALIZING})
"""What cancel can stop (cancelling / cancelled are answered as they are)."""
JOB_FINISHING_STATUSES: frozenset[JobStatus] = frozenset(
    {JobStatus.IN_PROGRESS, JobStatus.FINALIZING, JobStatus.CANCELLING})
"""States that end by themselves once no shard is open (finalize_if_done)."""


class RequestStatus(StrEnum):
    """One input line. pending -> succeeded | errored (by a worker, or at ingest for a bad line);
    pending -> canceled (job cancelled) | expired (job expired). Only pending rows ever change."""

    PENDING = "pending"
    SUCCEEDED = "succeeded"
    ERRORED = "errored"
    CANCELED = "canceled"
    EXPIRED = "expired"


REQUEST_NOT_RUN_STATUSES: frozenset[RequestStatus] = frozenset(
    {RequestStatus.CANCELED, RequestStatus.EXPIRED})
"""A request its job stopped before a worker ran it."""


class ShardStatus(StrEnum):
    """available -> running (claimed: lease_owner/lease_token/lease_expires_at set, attempt += 1)
    running -> available (released, or lease expired with attempts left)
    running -> completed | failed (max attempts used, or failed by the worker)
    available | running -> cancelled (job cancelled or expired)"""

    AVAILABLE = "available"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


SHARD_OPEN_STATUSES: frozenset[ShardStatus] = frozenset({ShardStatus.AVAILABLE, ShardStatus.RUNNING})
"""A shard in one of these still holds its job open."""


class ScheduleRunStatus(StrEnum):
    """pending (slot claimed) -> submitted (job created) -> completed | failed (outputs out, or no input)."""

    PENDING = "pending"
    SUBMITTED = "submitted"
    COMPLETED = "completed"
    FAILED = "failed"
