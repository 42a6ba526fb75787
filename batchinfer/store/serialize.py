"""Public representations: a job's Batch object and a file's File object (the one typed definition of
each is batchinfer.wire.batch / wire.file), built from rows here, and the public ids they carry.

Shared by the REST API, the CLI and the dashboard, so it imports neither FastAPI nor torch. Ids:

- `batch_<job id>`         a Job
- `file-<file id>`         an uploaded input file (purpose "batch")
- `file-out-<job id>`      the job's output file (purpose "batch_output"), generated from the DB on read
- `file-err-<job id>`      the job's error file (purpose "batch_output"), generated from the DB on read
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal, overload

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchinfer.store.models import JOB_TERMINAL_STATUSES, File, Job, JobStatus
from batchinfer.store.progress import InflightReport, estimate, inflight_by_job
from batchinfer.store.timeline import first_claim, first_claims, job_end
from batchinfer.store.workers import served_models
from batchinfer.wire.batch import (
    BatchErrorItem,
    BatchErrors,
    BatchObject,
    BatchProgress,
    Estimate,
    InputTokensDetails,
    RequestCounts,
    ResultCacheCounts,
    Usage,
)
from batchinfer.wire.file import FileObject

OUTPUT_FILE_PREFIX = "file-out-"
ERROR_FILE_PREFIX = "file-err-"
_BATCH_ID = re.compile(r"batch_([1-9][0-9]{0,17})")
_FILE_ID = re.compile(r"file-(?:(out|err)-)?([1-9][0-9]{0,17})")


FileKind = Literal["input", "output", "error"]


@dataclass(frozen=True, slots=True)
class FileRef:
    """A parsed public file id: an input file row, or a job's generated output/error file."""

    kind: FileKind
    id: int  # File.id for "input", Job.id otherwise


def parse_batch_id(batch_id: str) -> int | None:
    """The Job id behind `batch_<n>`, or None when the string is not a batch id."""
    match = _BATCH_ID.fullmatch(batch_id)
    return int(match.group(1)) if match else None


def parse_file_id(file_id: str) -> FileRef | None:
    """What a public file id points at, or None when the string is not one of ours."""
    match = _FILE_ID.fullmatch(file_id)
    if not match:
        return None
    kinds: dict[str | None, FileKind] = {"out": "output", "err": "error", None: "input"}
    kind = kinds[match.group(1)]
    return FileRef(kind=kind, id=int(match.group(2)))


def output_file_id(job: Job) -> str | None:
    """The id of the job's output file: set once the job is done and some request succeeded."""
    if job.status in JOB_TERMINAL_STATUSES and job.completed_requests > 0:
        return f"{OUTPUT_FILE_PREFIX}{job.id}"
    return None


def error_file_id(job: Job) -> str | None:
    """The id of the job's error file: set once the job is done and some request failed or never ran
    (its job was cancelled or expired first: `batch_cancelled` / `batch_expired` lines)."""
    if job.status in JOB_TERMINAL_STATUSES and job.error_lines > 0:
        return f"{ERROR_FILE_PREFIX}{job.id}"
    return None


@overload
def epoch(value: datetime) -> int: ...
@overload
def epoch(value: None) -> None: ...
@overload
def epoch(value: datetime | None) -> int | None: ...
def epoch(value: datetime | None) -> int | None:
    """Unix seconds of a timestamp (None stays None)."""
    return int(value.timestamp()) if value is not None else None


def waiting_note(job: Job, served_models: Collection[str]) -> str | None:
    """Why an in-progress job with work left does not move: no live worker serves its model (else None)."""
    if job.status != JobStatus.IN_PROGRESS or job.model in served_models:
        return None
    if job.completed_requests + job.failed_requests >= job.total_requests:
        return None
    served = ", ".join(served_models) if served_models else "none (no worker is live)"
    return (f"no live worker serves model {job.model!r}; workers serve: {served}. Start one with "
            f"`batchinfer worker --model {job.model}`, or the batch expires at the end of its "
            f"completion_window ({job.completion_window})")


def _progress(job: Job, now: datetime, note: str | None, started_at: datetime | None,
              inflight: InflightReport | None) -> BatchProgress:
    """Fraction done, and the throughput and ETA measured in tokens from the first claim on (store.progress).

    The time a job waited for a worker or a model load is no throughput, so the clock starts at the first
    claim (falling back to in_progress_at when unknown); tokens count those of finished requests and those
    the workers' in-flight requests generated so far (`inflight`, their last heartbeats); requests that
    failed at ingest (`num_errors`) are not work done by a worker. A batch that ended with no request
    (failed at validation: 0/0) is 0 done, not a full bar; a completed one is.
    """
    done = job.completed_requests + job.failed_requests
    total = job.total_requests
    fraction = min(1.0, done / total) if total else (1.0 if job.status == JobStatus.COMPLETED else 0.0)
    requests_per_second = input_tokens_per_second = None
    start = started_at or job.in_progress_at
    elapsed = None
    run_done = max(done - (job.num_errors or 0), 0)
    if start is not None:
        elapsed = max(((job_end(job) or now) - start).total_seconds(), 1e-6)
        requests_per_second = round(run_done / elapsed, 3)
        input_tokens_per_second = round(job.prompt_tokens / elapsed, 2)  # embeddings: tokens embedded
    measured = estimate(total=total, done=done, worker_done=run_done, finished_tokens=job.completion_tokens,
                        inflight=inflight or InflightReport(), elapsed_s=elapsed,
                        running=job.status == JobStatus.IN_PROGRESS)
    risky = at_risk(job, now, measured.eta_seconds)
    if note is None and risky:
        note = (f"at risk: expected to finish in {measured.eta_seconds:.0f} s, after its deadline "
                f"{job.expires_at:%Y-%m-%d %H:%M:%S} UTC (created_at + completion_window "
                f"{job.completion_window})")
    return BatchProgress(
        fraction=round(fraction, 4), tokens_per_second=measured.tokens_per_second,
        requests_per_second=requests_per_second, eta_seconds=measured.eta_seconds,
        started_at=epoch(started_at), generated_tokens=measured.generated_tokens,
        remaining_tokens=measured.remaining_tokens, input_tokens_per_second=input_tokens_per_second,
        at_risk=risky, note=note)


def at_risk(job: Job, now: datetime, eta_seconds: float | None) -> bool:
    """A running job whose predicted finish (now + its ETA) falls after its deadline (expires_at)."""
    if job.status != JobStatus.IN_PROGRESS or eta_seconds is None or job.expires_at is None:
        return False
    return now + timedelta(seconds=eta_seconds) > job.expires_at


def batch_object(job: Job, *, now: datetime | None = None, served_models: Collection[str] | None = None,
                 started_at: datetime | None = None, inflight: InflightReport | None = None) -> BatchObject:
    """The OpenAI Batch object of a job, plus the `progress` extension (ignored by OpenAI clients).

    With `served_models` (store.workers.served_models) a job no live worker can run says so in
    `progress.note`; with `started_at` (store.timeline.first_claim) throughput and ETA are measured
    from the first claim, not from in_progress_at; with `inflight` (store.progress.inflight_by_job) they
    count the tokens in-flight requests generated so far.
    """
    now = now or datetime.now(UTC)
    errors = None
    if job.errors:  # the JSON column's [{code, message, line, param}] (ingest's line errors)
        errors = BatchErrors(data=[BatchErrorItem.model_validate(error) for error in job.errors])
    note = waiting_note(job, served_models) if served_models is not None else None
    return BatchObject(
        id=job.batch_id,
        endpoint=job.endpoint,  # None: created without one (CLI), each line may use either endpoint
        model=job.model,
        errors=errors,
        input_file_id=f"file-{job.input_file_id}" if job.input_file_id is not None else None,
        completion_window=job.completion_window,
        status=JobStatus(job.status),
        output_file_id=output_file_id(job),
        error_file_id=error_file_id(job),
        created_at=epoch(job.created_at),
        in_progress_at=epoch(job.in_progress_at),
        expires_at=epoch(job.expires_at),
        finalizing_at=epoch(job.finalizing_at),
        completed_at=epoch(job.completed_at),
        failed_at=epoch(job.failed_at),
        expired_at=epoch(job.expired_at),
        cancelling_at=epoch(job.cancelling_at),
        cancelled_at=epoch(job.cancelled_at),
        request_counts=RequestCounts(total=job.total_requests, completed=job.completed_requests,
                                     failed=job.failed_requests),
        metadata=job.meta or None,
        usage=Usage(input_tokens=job.prompt_tokens,
                    input_tokens_details=InputTokensDetails(cached_tokens=job.cached_tokens),
                    output_tokens=job.completion_tokens,
                    total_tokens=job.prompt_tokens + job.completion_tokens),
        max_total_tokens=job.max_total_tokens,  # the token budget (None: none), store.budgets
        estimate=Estimate.model_validate(job.estimate) if job.estimate else None,  # made at submit
        progress=_progress(job, now, note, started_at, inflight),
        result_cache=ResultCacheCounts(mode=job.result_cache or "use", hits=job.result_cache_hits or 0,
                                       dedups=job.result_cache_dedups or 0),  # store/result_cache.py
    )


def current_batch_object(session: Session, job: Job) -> BatchObject:
    """batch_object plus what only the database can tell now: `progress.note` when no live worker serves
    an in-progress job's model (one small read of the workers table, only for in-progress jobs), and the
    first claim of its shards, where throughput and ETA are measured from (one indexed MIN), and what its
    running shards generated so far (one indexed SUM)."""
    running = job.status == JobStatus.IN_PROGRESS
    served = served_models(session) if running else None
    inflight = inflight_by_job(session, job_ids=[job.id]).get(job.id) if running else None
    return batch_object(job, served_models=served, started_at=first_claim(session, job_id=job.id),
                        inflight=inflight)


def jobs_at_risk(session: Session, *, now: datetime | None = None, limit: int = 1000) -> int:
    """How many of the `limit` newest in-progress jobs are at risk (progress.at_risk): the metric's count."""
    jobs = list(session.scalars(select(Job).where(Job.status == JobStatus.IN_PROGRESS)
                                .order_by(Job.id.desc()).limit(limit)))
    ids = [job.id for job in jobs]
    started, inflight = first_claims(session, job_ids=ids), inflight_by_job(session, job_ids=ids)
    return sum(batch_object(job, now=now, started_at=started.get(job.id),
                            inflight=inflight.get(job.id)).progress.at_risk for job in jobs)


def file_object(file: File) -> FileObject:
    """The OpenAI File object of an uploaded file."""
    return FileObject(id=file.file_id, bytes=file.bytes, created_at=epoch(file.created_at),
                      expires_at=epoch(file.expires_at), filename=file.filename,
                      purpose="batch")  # the only purpose an upload may have (files.UPLOAD_PURPOSES)


def result_file_object(job: Job, kind: Literal["output", "error"], *, size: int) -> FileObject:
    """The OpenAI File object of a job's generated output or error file (`size` in bytes)."""
    prefix = OUTPUT_FILE_PREFIX if kind == "output" else ERROR_FILE_PREFIX
    created = job.completed_at or job.cancelled_at or job.expired_at or job.failed_at or job.created_at
    return FileObject(id=f"{prefix}{job.id}", bytes=size, created_at=epoch(created),
                      expires_at=(epoch(created + timedelta(seconds=job.output_expires_after))  # purged then
                                  if job.output_expires_after is not None else None),
                      filename=f"batch_{job.id}_{kind}.jsonl", purpose="batch_output")
