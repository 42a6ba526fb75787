"""What the dashboard's pages show, read through the store's services (the routes hold no SQL).

Every figure is the REST API's: a job row is its batch object (store.serialize, with the first claim for
throughput and ETA), a worker row is what the worker reported in its heartbeat (workers.metrics).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TypedDict

from pydantic import BaseModel
from sqlalchemy.orm import Session

from batchinfer.engine.metrics import model_label
from batchinfer.store.columns import utcnow
from batchinfer.store.jobs import get_job, list_jobs
from batchinfer.store.models import JOB_CANCELLABLE_STATUSES, JOB_TERMINAL_STATUSES, Job, JobStatus
from batchinfer.store.request_errors import request_errors
from batchinfer.store.serialize import batch_object, current_batch_object, parse_batch_id
from batchinfer.store.timeline import first_claims, token_timeline
from batchinfer.store.workers import list_workers, served_models
from batchinfer.wire.batch import BatchErrorItem, BatchObject

JOBS_ON_PAGE = 50
ERRORS_PREVIEW = 10
# A heartbeat, or a last generated token, older than this says the worker is not generating now (a busy
# worker beats every 10 s).
THROUGHPUT_FRESH_S = 15.0

_TONES: dict[str, str] = {
    JobStatus.COMPLETED: "ok", JobStatus.IN_PROGRESS: "busy", JobStatus.FINALIZING: "busy",
    JobStatus.VALIDATING: "busy", JobStatus.CANCELLING: "warn", JobStatus.CANCELLED: "muted",
    JobStatus.EXPIRED: "warn", JobStatus.FAILED: "bad",
}


def duration(seconds: float | None) -> str:
    """h:mm:ss, or m:ss under an hour; an em dash when unknown."""
    if seconds is None:
        return "\u2014"
    hours, rest = divmod(max(0, round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def ago(seconds: float) -> str:
    """How long ago, in words a glance reads: 4 s, 3 min, 2 h."""
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s ago"
    return f"{seconds // 60} min ago" if seconds < 7200 else f"{seconds // 3600} h ago"


def tone(status: str) -> str:
    """The colour family of a status badge."""
    return _TONES.get(status, "muted")


class ErrorPreview(BaseModel):
    """One row of a batch page's errors: where (`line N`, or `file` for the whole file), code, message."""

    where: str
    code: str
    message: str


class BatchRow(BatchObject):
    """A batch object plus what a table row and the batch page show (the figures are the REST API's)."""

    owner: str
    done: int
    rate: float
    rate_unit: str
    generated: int
    percent: float
    model_name: str
    live: bool
    cancellable: bool
    tone: str
    eta: str
    created: str
    estimated: str
    errors_preview: list[ErrorPreview] = []


def _row(batch: BatchObject, *, owner: str, errors: list[ErrorPreview] | None = None) -> BatchRow:
    """A batch object plus what a table row shows."""
    counts, progress, usage = batch.request_counts, batch.progress, batch.usage
    # An embeddings batch generates nothing: its throughput is the input tokens it embedded.
    embeds = not usage.output_tokens and bool(usage.input_tokens)
    rate = (progress.input_tokens_per_second if embeds else progress.tokens_per_second) or 0.0
    return BatchRow.model_construct(
        **dict(batch), owner=owner, done=counts.completed + counts.failed, rate=rate,
        rate_unit="input tok/s" if embeds else "tok/s",
        generated=progress.generated_tokens or usage.output_tokens or 0,
        percent=round(100.0 * (progress.fraction or 0.0), 1), model_name=model_label(batch.model or ""),
        live=batch.status not in JOB_TERMINAL_STATUSES, cancellable=batch.status in JOB_CANCELLABLE_STATUSES,
        tone=tone(batch.status), eta=duration(progress.eta_seconds), created=_clock(batch.created_at),
        estimated=duration(batch.estimate.expected_seconds if batch.estimate else None),
        errors_preview=errors or [])


def jobs_view(session: Session, *, owner: str | None, limit: int = JOBS_ON_PAGE) -> list[BatchRow]:
    """The owner's newest jobs as table rows (every owner's when `owner` is None: the admin view)."""
    jobs = list_jobs(session, owner=owner, limit=limit)
    served = served_models(session)
    started = first_claims(session, job_ids=[job.id for job in jobs])
    return [_row(batch_object(job, served_models=served, started_at=started.get(job.id)), owner=job.owner)
            for job in jobs]


def find_job(session: Session, *, owner: str | None, batch_id: str) -> Job | None:
    """The owner's job behind `batch_id` (None for another owner's job, like the REST API's 404; any
    owner's when `owner` is None: the admin view)."""
    job_id = parse_batch_id(batch_id)
    return get_job(session, job_id=job_id, owner=owner) if job_id is not None else None


def batch_view(session: Session, job: Job) -> BatchRow:
    """One job's page: its row, and the first error lines."""
    return _row(current_batch_object(session, job), owner=job.owner, errors=errors_preview(session, job))


def errors_preview(session: Session, job: Job, *, limit: int = ERRORS_PREVIEW) -> list[ErrorPreview]:
    """The first `limit` errors: the input file's line errors, then the failed requests (their line
    numbers read from data: the listed errors' `line`, the requests' own line_number).

    Only reads the requests when some request failed after ingest (failed_requests > num_errors).
    """
    out: list[ErrorPreview] = []
    listed: set[int] = set()
    for error in (job.errors or [])[:limit]:
        item = BatchErrorItem.model_validate(error)
        where = f"line {item.line}" if item.line else "file"
        if item.line:
            listed.add(item.line)
        out.append(ErrorPreview(where=where, code=item.code or "",
                                message=(item.message or "").removeprefix(f"{where}: ")))
    if len(out) < limit and job.failed_requests > job.num_errors:
        for failed in request_errors(session, job_id=job.id, limit=len(listed) + limit):
            if failed.line in listed:  # an ingest error listed above
                continue
            out.append(ErrorPreview(where=f"line {failed.line}", code=failed.code, message=failed.detail))
            if len(out) >= limit:
                break
    return out


class Timeline(TypedDict):
    """The tokens/s chart's data (JSON): unix times, tokens per second at each, whether the job ended."""

    at: list[float]
    tokens_per_second: list[float]
    final: bool


class WorkerRow(TypedDict):
    """One live worker as the workers table shows it."""

    id: str
    model: str
    model_name: str
    process: str
    shards: list[int]
    tokens_per_second: float
    metrics_port: int | None
    heartbeat: str
    busy: bool


def timeline_view(session: Session, job: Job) -> Timeline:
    """The tokens/s chart's data: times (unix s) and tokens per second; `final` once the job ended.

    Each bucket's rate is drawn at its end (when it was measured), after a 0 at the first claim, so the
    line starts as soon as one bucket exists.
    """
    points = token_timeline(session, job=job)
    at = [points[0].start] if points else []
    rates = [0.0] if points else []
    for point in points:
        at.append(point.end)
        rates.append(point.tokens_per_second)
    # Microseconds: a running job's last bucket can be a few ms wide, and rate x width must give its tokens.
    return {"at": [round(t, 6) for t in at], "tokens_per_second": rates,
            "final": job.status in JOB_TERMINAL_STATUSES}


def model_choices(models: Iterable[str]) -> dict[str, str]:
    """The upload form's models, {name shown: model}: a local path by its directory's name (model_label, as
    the tables show it), unless another model shares that name; a hub id, alias or adapter as it is."""
    names = set(models)
    labels = Counter(model_label(model) for model in names)
    choices = {}
    for model in sorted(names):
        label = model_label(model)
        readable = labels[label] == 1 and (label == model or label not in names)
        choices[label if readable else model] = model
    return choices


def upload_models(session: Session, *, default_model: str) -> dict[str, str]:
    """model_choices of what live workers serve (adapters included) and the default model."""
    return model_choices([*served_models(session), default_model])


def workers_view(session: Session, *, now: datetime | None = None) -> list[WorkerRow]:
    """Live workers: model, current throughput (their last heartbeat's), shards held, metrics port."""
    now = now or utcnow()
    rows: list[WorkerRow] = []
    for worker in list_workers(session, now=now):
        info = worker.info or {}
        age = (now - worker.last_heartbeat_at).total_seconds()
        generated_at = info.get("generated_at")
        # An instantaneous figure: 0 once the worker generated nothing for a rate window (idle), whatever
        # its last busy heartbeat said.
        generating = generated_at is not None and now.timestamp() - generated_at <= THROUGHPUT_FRESH_S
        rate = info.get("tokens_per_second") if age <= THROUGHPUT_FRESH_S and generating else 0.0
        rows.append({"id": worker.worker_id, "model": worker.model, "model_name": model_label(worker.model),
                     "process": f"{worker.hostname}:{worker.pid}", "shards": worker.shard_ids,
                     "tokens_per_second": rate or 0.0,
                     "metrics_port": info.get("metrics_port"), "heartbeat": ago(age),
                     "busy": bool(worker.shard_ids)})
    return rows


def _clock(epoch: int | None) -> str:
    if epoch is None:
        return ""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
