"""Public representations: OpenAI Batch and File objects, and the public ids they carry.

Shared by the REST API and the CLI, so it imports neither FastAPI nor torch. Ids:

- `batch_<job id>`         a Job
- `file-<file id>`         an uploaded input file (purpose "batch")
- `file-out-<job id>`      the job's output file (purpose "batch_output"), generated from the DB on read
- `file-err-<job id>`      the job's error file (purpose "batch_output"), generated from the DB on read
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from batchinfer.store.models import JOB_TERMINAL_STATUSES, File, Job, JobStatus

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
    kind: FileKind = {"out": "output", "err": "error", None: "input"}[match.group(1)]
    return FileRef(kind=kind, id=int(match.group(2)))


def output_file_id(job: Job) -> str | None:
    """The id of the job's output file: set once the job is done and some request succeeded."""
    if job.status in JOB_TERMINAL_STATUSES and job.completed_requests > 0:
        return f"{OUTPUT_FILE_PREFIX}{job.id}"
    return None


def error_file_id(job: Job) -> str | None:
    """The id of the job's error file: set once the job is done and some request failed."""
    if job.status in JOB_TERMINAL_STATUSES and job.failed_requests > 0:
        return f"{ERROR_FILE_PREFIX}{job.id}"
    return None


def epoch(value: datetime | None) -> int | None:
    """Unix seconds of a timestamp (None stays None)."""
    return int(value.timestamp()) if value is not None else None


def _progress(job: Job, now: datetime) -> dict[str, Any]:
    done = job.completed_requests + job.failed_requests
    total = job.total_requests
    fraction = min(1.0, done / total) if total else (1.0 if job.status in JOB_TERMINAL_STATUSES else 0.0)
    tokens_per_second = eta_seconds = None
    if job.in_progress_at is not None:
        end = (job.finalizing_at or job.completed_at or job.cancelled_at or job.expired_at or job.failed_at
               or now)
        elapsed = max((end - job.in_progress_at).total_seconds(), 1e-6)
        tokens_per_second = round(job.completion_tokens / elapsed, 2)
        if job.status == JobStatus.IN_PROGRESS and 0 < done < total:
            eta_seconds = round(elapsed * (total - done) / done, 1)
    return {"fraction": round(fraction, 4), "tokens_per_second": tokens_per_second,
            "eta_seconds": eta_seconds}


def batch_object(job: Job, *, now: datetime | None = None) -> dict[str, Any]:
    """The OpenAI Batch object of a job, plus the `progress` extension (ignored by OpenAI clients)."""
    now = now or datetime.now(UTC)
    errors = None
    if job.errors:
        errors = {
            "object": "list",
            "data": [
                {"code": e.get("code"), "line": e.get("line"), "message": e.get("message"),
                 "param": e.get("param")}
                for e in job.errors
            ],
        }
    return {
        "id": job.batch_id,
        "object": "batch",
        "endpoint": job.endpoint,  # None: created without one (CLI), each line may use either endpoint
        "model": job.model,
        "errors": errors,
        "input_file_id": f"file-{job.input_file_id}" if job.input_file_id is not None else None,
        "completion_window": job.completion_window,
        "status": str(job.status),
        "output_file_id": output_file_id(job),
        "error_file_id": error_file_id(job),
        "created_at": epoch(job.created_at),
        "in_progress_at": epoch(job.in_progress_at),
        "expires_at": epoch(job.expires_at),
        "finalizing_at": epoch(job.finalizing_at),
        "completed_at": epoch(job.completed_at),
        "failed_at": epoch(job.failed_at),
        "expired_at": epoch(job.expired_at),
        "cancelling_at": epoch(job.cancelling_at),
        "cancelled_at": epoch(job.cancelled_at),
        "request_counts": {
            "total": job.total_requests,
            "completed": job.completed_requests,
            "failed": job.failed_requests,
        },
        "metadata": job.meta or None,
        "usage": {
            "input_tokens": job.prompt_tokens,
            "input_tokens_details": {"cached_tokens": job.cached_tokens},
            "output_tokens": job.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": job.prompt_tokens + job.completion_tokens,
        },
        "progress": _progress(job, now),
    }


def file_object(file: File) -> dict[str, Any]:
    """The OpenAI File object of an uploaded file."""
    return {
        "id": file.file_id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": epoch(file.created_at),
        "expires_at": epoch(file.expires_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }


def result_file_object(job: Job, kind: Literal["output", "error"], *, size: int) -> dict[str, Any]:
    """The OpenAI File object of a job's generated output or error file (`size` in bytes)."""
    prefix = OUTPUT_FILE_PREFIX if kind == "output" else ERROR_FILE_PREFIX
    created = job.completed_at or job.cancelled_at or job.expired_at or job.failed_at or job.created_at
    return {
        "id": f"{prefix}{job.id}",
        "object": "file",
        "bytes": size,
        "created_at": epoch(created),
        "expires_at": None,
        "filename": f"batch_{job.id}_{kind}.jsonl",
        "purpose": "batch_output",
        "status": "processed",
        "status_details": None,
    }
