"""Retry what failed (issue 31): a child job of a finished job's failed, expired or cancelled lines.

The child runs the parent's original input lines (read from its input file by line number, so every field
is as the user wrote it), on the same model, endpoint, priority, shard size and result_cache mode, with
`retry_of: batch_N` added to its metadata. Lines that can never succeed (invalid input: rejected at ingest,
no request was stored) are named and left out unless asked for. Deterministic lines that succeeded are not
in the child at all; with the result cache a retried twin of one may still be a hit.
"""

from __future__ import annotations

import io
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction
from batchinfer.store.errors import JobError, JobNotFound, JobStateError
from batchinfer.store.models import (
    JOB_TERMINAL_STATUSES,
    LINE_BITS,
    Job,
    Request,
    RequestStatus,
    request_id_for,
)

# What `--only` names -> the request statuses it retries.
RETRY_KINDS: dict[str, tuple[RequestStatus, ...]] = {
    "failed": (RequestStatus.ERRORED,),
    "expired": (RequestStatus.EXPIRED,),
    "cancelled": (RequestStatus.CANCELED,),
}


class RetrySubmitArgs(TypedDict):
    """store.jobs.submit_job's arguments for a child job: the parent's, its metadata naming the parent."""

    model: str
    owner: str
    endpoint: str | None
    priority: int
    shard_size: int
    result_cache: str
    completion_window: str
    metadata: dict[str, str]


class LeftOutLine(TypedDict):
    """An invalid line not retried: its line number and the error code ingest gave it."""

    line: int
    code: str | None


@dataclass
class RetryInput:
    """A child job's input and its submit arguments; `left_out`: invalid lines not retried."""

    stream: io.BytesIO
    lines: list[int]
    submit_args: RetrySubmitArgs
    left_out: list[LeftOutLine] = field(default_factory=list)


def check_kinds(only: Collection[str] | None) -> tuple[str, ...]:
    """The retry kinds named (all three when none); JobError naming `only` and the choices otherwise."""
    kinds = tuple(dict.fromkeys(only)) if only else tuple(RETRY_KINDS)
    unknown = [kind for kind in kinds if kind not in RETRY_KINDS]
    if unknown:
        raise JobError(f"only: {unknown[0]!r} is not a kind of line to retry; use {', '.join(RETRY_KINDS)}")
    return kinds


def retry_input(session: Session, *, job_id: int, owner: str | None = None,
                only: Collection[str] | None = None, include_invalid: bool = False) -> RetryInput:
    """The child job of `job_id`'s lines of the kinds `only` (module docstring). JobNotFound when it is not
    the owner's; JobStateError while it runs; JobError when nothing is left to retry or its input is gone."""
    kinds = check_kinds(only)
    job = session.get(Job, job_id)
    if job is None or (owner is not None and job.owner != owner):
        raise JobNotFound(f"batch_{job_id} not found")
    if job.status not in JOB_TERMINAL_STATUSES:
        raise JobStateError(f"batch_{job_id} is {job.status}: retry it once it has ended", status=job.status)
    statuses = [status.value for kind in kinds for status in RETRY_KINDS[kind]]
    first, last = request_id_for(job_id, 0), request_id_for(job_id, (1 << LINE_BITS) - 1)
    rows = session.execute(select(Request.line_number, Request.payload.is_(None), Request.error_code)
                           .where(Request.id > first, Request.id <= last, Request.status.in_(statuses))
                           .order_by(Request.id)).all()
    submit_args = RetrySubmitArgs(model=job.model, owner=job.owner, endpoint=job.endpoint,
                                  priority=job.priority, shard_size=job.shard_size,
                                  result_cache=job.result_cache, completion_window=job.completion_window,
                                  metadata={**(job.meta or {}), "retry_of": job.batch_id})
    input_path = job.input_path
    end_transaction(session)
    lines: list[int] = []
    left_out: list[LeftOutLine] = []
    for line_number, invalid, code in rows:
        if invalid and not include_invalid:
            left_out.append(LeftOutLine(line=line_number, code=code))
        else:
            lines.append(line_number)
    if not lines:
        kinds_text = ", ".join(kinds)
        raise JobError(f"batch_{job_id} has no {kinds_text} lines to retry"
                       + (f" ({len(left_out)} invalid ones left out: include_invalid retries them)"
                          if left_out else ""))
    return RetryInput(_read_lines(input_path, lines, job_id), lines, submit_args, left_out)


def _read_lines(input_path: str | None, lines: list[int], job_id: int) -> io.BytesIO:
    """The input file's lines `lines` (1-based, as ingest numbered them), in order."""
    if not input_path or not Path(input_path).is_file():
        raise JobError(f"batch_{job_id}: its input file {input_path or '(none)'} is gone; submit the lines "
                       "again as a new batch")
    wanted = set(lines)
    out = io.BytesIO()
    with open(input_path, "rb") as source:
        for number, raw in enumerate(source, start=1):
            if number in wanted:
                out.write(raw.rstrip(b"\r\n") + b"\n")
                wanted.discard(number)
                if not wanted:
                    break
    if wanted:
        raise JobError(f"batch_{job_id}: its input file {input_path} changed (line {min(wanted)} is gone); "
                       "submit the lines again as a new batch")
    out.seek(0)
    return out
