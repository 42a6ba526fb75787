"""Job service: submit (ingest and shard), get, list, cancel, expire.

Every function takes the session first and keyword arguments after it, and leaves the session with no
open transaction (see db.end_transaction). Functions that change state commit (each is one write
transaction, `BEGIN IMMEDIATE` on SQLite) and take their locks through store.transitions. Use sessions
from db.session_factory (expire_on_commit=False), so returned objects stay readable after those commits.
Settings are passed in (`settings=`); nothing here reads the process settings.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import BinaryIO, Literal, TypeVar

from sqlalchemy import ColumnElement, Engine, delete, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store.budgets import check_budget
from batchinfer.store.db import end_transaction, single_flight, write_transaction
from batchinfer.store.errors import JobError, JobStateError
from batchinfer.store.estimate import from_counts
from batchinfer.store.ids import MAX_JOB_ID, is_job_id
from batchinfer.store.ingest import MAX_LISTED_ERRORS, IngestLimits, IngestResult, ingest_file, make_shards
from batchinfer.store.ingest_lease import IngestLease, IngestLeaseLost, new_ingest_owner, release_lost_ingest
from batchinfer.store.line_models import ModelRouting
from batchinfer.store.models import (
    JOB_CANCELLABLE_STATUSES,
    JOB_LIVE_STATUSES,
    Job,
    JobStatus,
    Request,
    utcnow,
)
from batchinfer.store.quotas import charge_storage
from batchinfer.store.result_cache import check_mode as check_result_cache_mode
from batchinfer.store.transitions import finalize_if_done, lock_job, stop_pending
from batchinfer.wire.batch import BatchErrorItem
from batchinfer.wire.input_line import validate_metadata
from batchinfer.wire.request import URL_TO_ENDPOINT

logger = logging.getLogger(__name__)

OnInvalid = Literal["skip", "fail"]
EXPIRY_LOCK_KEY = 0x6578706972  # pg advisory lock id of expire_jobs: "expir"
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_WINDOW_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_COMPLETION_WINDOW = timedelta(days=30)
"""The longest completion_window accepted: a job that may wait longer is better resubmitted later."""
MAX_COMPLETION_WINDOW_TEXT = "30d"  # MAX_COMPLETION_WINDOW as a window string, for messages
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class CompletionWindow:
    """A checked completion_window: its text as stored ('0024h ' -> '24h') and its length."""

    text: str
    delta: timedelta


def parse_completion_window(window: str) -> CompletionWindow:
    """'24h' -> CompletionWindow('24h', 24 hours); accepts <n>s, <n>m, <n>h, <n>d up to MAX_COMPLETION_WINDOW.

    JobError naming the field `completion_window` otherwise. A submit parses its window here once.
    """
    match = _WINDOW.match(window.strip())
    if not match or int(match.group(1)) <= 0:
        raise JobError(f"completion_window {window[:32]!r} is not valid; use e.g. '24h' (units s, m, h, d)",
                       field="completion_window")
    amount, unit = int(match.group(1)), match.group(2)
    if amount * _UNIT_SECONDS[unit] > MAX_COMPLETION_WINDOW.total_seconds():  # before timedelta can overflow
        raise JobError(f"completion_window {window.strip()[:32]!r} is longer than the maximum of "
                       f"{MAX_COMPLETION_WINDOW_TEXT}; use a window up to {MAX_COMPLETION_WINDOW_TEXT} "
                       "(e.g. '24h')", field="completion_window")
    return CompletionWindow(text=f"{amount}{unit}", delta=timedelta(**{_WINDOW_UNITS[unit]: amount}))


def check_stored_text(value: str, *, field: str, column: ColumnElement[str]) -> None:
    """JobError naming `field` unless `value` can be stored in `column` as given (both databases).

    PostgreSQL text cannot hold the NUL character and a VARCHAR(n) refuses longer values: either would
    otherwise fail the insert with a database error instead of a message about the field.
    """
    if not value:
        raise JobError(f"{field} must not be empty", field=field)
    if "\x00" in value:
        raise JobError(f"{field} {value[:64]!r} contains the NUL character (\\u0000); remove it", field=field)
    max_chars = getattr(column.type, "length", None)
    if max_chars is not None and len(value) > max_chars:
        raise JobError(f"{field} is {len(value)} characters long; the limit is {max_chars}", field=field)


def _field_checked(field: str, check: Callable[[_T], _R], value: _T) -> _R:
    """check(value), its JobError or ValueError naming `field` (the checks of other modules know no field)."""
    try:
        return check(value)
    except JobError as exc:
        if exc.field is not None:
            raise
        raise JobError(exc.message, field=field, line=exc.line) from None
    except ValueError as exc:
        raise JobError(str(exc), field=field) from None


def submit_job(
    session: Session,
    *,
    settings: Settings,
    model: str,
    path: str | Path | None = None,
    stream: BinaryIO | None = None,
    input_file_id: int | None = None,
    owner: str = "",
    endpoint: str | None = None,
    shard_size: int | None = None,
    priority: int = 0,
    metadata: dict[str, str] | None = None,
    idempotency_key: str | None = None,
    on_invalid: OnInvalid = "skip",
    completion_window: str | None = None,
    limits: IngestLimits | None = None,
    output_expires_after: int | None = None,
    max_total_tokens: int | None = None,
    result_cache: str | None = None,
    served_names: frozenset[str] | None = None,
    adapter_names: frozenset[str] = frozenset(),
    reserve: Callable[[Session, Job], None] | None = None,
) -> Job:
    """Create a job from a JSONL file (`path`, or a binary `stream`), ingest it and cut it into shards.

    Returns the job `in_progress`, or `failed` with line-numbered `errors` when the file is unusable
    (or has a bad line and on_invalid="fail"). The same (owner, idempotency_key) returns the first job.
    `endpoint` (an OpenAI url), when given, is required of every line. `priority`: lower runs first.
    Unset shard_size, completion_window and limits come from `settings`; JobError for a bad argument.
    `output_expires_after`: seconds after the job ends that its rows are kept (store.retention).
    `result_cache`: use | refresh | off (store/result_cache.py); None: the setting's default.
    `served_names`: the job runs in this process on `model` alone, also called these names (line_models.py),
    with the LoRA adapters `adapter_names`.
    `reserve(session, job)`: runs in the transaction inserting the job, before it (store.quotas.reserve_job).
    """
    if (path is None) == (stream is None):
        raise JobError("give exactly one of path= or stream=")
    if on_invalid not in ("skip", "fail"):
        raise JobError(f"on_invalid must be 'skip' or 'fail', got {on_invalid!r}", field="on_invalid")
    if endpoint is not None and endpoint not in URL_TO_ENDPOINT:
        raise JobError(f"Unsupported endpoint {endpoint[:64]!r}: use one of "
                       f"{', '.join(sorted(URL_TO_ENDPOINT))}", field="endpoint")
    shard_size = shard_size or settings.shard_size
    if shard_size < 1:
        raise JobError(f"shard_size must be >= 1, got {shard_size}", field="shard_size")
    limits = limits or IngestLimits.from_settings(settings, model)
    metadata = _field_checked("metadata", partial(validate_metadata, max_bytes=limits.max_metadata_bytes),
                              metadata)
    window = parse_completion_window(completion_window or settings.completion_window)
    result_cache = _field_checked("result_cache", check_result_cache_mode,
                                  result_cache or settings.result_cache)
    max_total_tokens = _field_checked("max_total_tokens", check_budget, max_total_tokens)  # store.budgets
    check_stored_text(model, field="model", column=Job.__table__.c.model)
    if idempotency_key is not None:
        check_stored_text(idempotency_key, field="idempotency_key", column=Job.__table__.c.idempotency_key)

    if idempotency_key is not None:
        existing = _job_by_idempotency_key(session, owner, idempotency_key)
        if existing is not None and not release_lost_ingest(session, job=existing):
            return existing
    file = open(path, "rb") if path is not None else None  # noqa: SIM115 - closed below; fail before creating
    now = utcnow()
    ingest_owner = new_ingest_owner()
    job = Job(owner=owner, model=model, endpoint=endpoint, status=JobStatus.VALIDATING,
              input_file_id=input_file_id, input_path=str(path) if path is not None else None,
              completion_window=window.text, priority=priority, shard_size=shard_size, on_invalid=on_invalid,
              meta=metadata, idempotency_key=idempotency_key, created_at=now, expires_at=now + window.delta,
              max_total_tokens=max_total_tokens,
              output_expires_after=output_expires_after, result_cache=result_cache,
              ingest_owner=ingest_owner,
              ingest_lease_expires_at=now + timedelta(seconds=settings.ingest_lease_seconds))
    try:
        with write_transaction(session):
            if reserve is not None:
                reserve(session, job)  # QuotaExceeded: nothing was written
            session.add(job)
    except BaseException as exc:
        if file is not None:
            file.close()
        if not isinstance(exc, IntegrityError):
            raise
        # a concurrent submit with the same idempotency key won
        existing = _job_by_idempotency_key(session, owner, idempotency_key)
        if existing is None:
            raise
        return existing
    source = file or stream
    if source is None:  # checked above: exactly one of path= and stream=
        raise JobError("give exactly one of path= or stream=")
    try:
        with IngestLease.of_session(session, job_id=job.id, owner=ingest_owner,
                                    lease_seconds=settings.ingest_lease_seconds) as lease:
            _ingest(session, job, source, limits, settings, lease.check, served_names, adapter_names)
    except IngestLeaseLost:  # the rescuer failed the job meanwhile: drop what this submit wrote since
        session.rollback()
        with write_transaction(session):
            session.execute(delete(Request).where(Request.job_id == job.id))
    except Exception as exc:
        session.rollback()
        _fail_job(session, job.id, [BatchErrorItem(code="ingest_error", message=f"ingest stopped: {exc!r}")])
        raise
    finally:
        if file is not None:
            file.close()
    session.refresh(job)
    end_transaction(session)
    return job


def _job_by_idempotency_key(session: Session, owner: str, key: str | None) -> Job | None:
    job = session.scalar(select(Job).where(Job.owner == owner, Job.idempotency_key == key))
    end_transaction(session)
    return job


def job_id_by_idempotency_key(session: Session, *, owner: str, key: str) -> int | None:
    """The id of the owner's job submitted under `key`, or None (its first commit has not happened yet)."""
    job_id = session.scalar(select(Job.id).where(Job.owner == owner, Job.idempotency_key == key))
    end_transaction(session)
    return job_id


def _ingest(session: Session, job: Job, stream: BinaryIO, limits: IngestLimits, settings: Settings,
            check_lease: Callable[[], None], served_names: frozenset[str] | None = None,
            adapter_names: frozenset[str] = frozenset()) -> None:
    stop_after = MAX_LISTED_ERRORS if job.on_invalid == "fail" else None
    bind = session.get_bind()
    engine = bind if isinstance(bind, Engine) else bind.engine
    routing = ModelRouting.at_ingest(session, default=job.model, served_names=served_names,
                                     adapter_names=adapter_names)
    result = ingest_file(engine, job_id=job.id, stream=stream, limits=limits, endpoint=job.endpoint,
                         stop_after_errors=stop_after, check_lease=check_lease, routing=routing)
    if result.fatal is None and result.valid == 0:
        result.fatal = ("the file is empty" if result.total == 0 else
                        f"no valid request in {result.total} line(s); is this a JSONL batch file?")
    if result.fatal is None and result.invalid and job.on_invalid == "fail":
        result.fatal = (f"{result.invalid} invalid line(s) and on_invalid='fail'; fix them or use "
                        "on_invalid='skip'")
    if result.fatal is not None:
        errors = [BatchErrorItem(code="invalid_file", message=result.fatal),
                  *(BatchErrorItem.model_validate(error) for error in result.errors)]
        _fail_job(session, job.id, errors, num_errors=result.invalid)
        return
    estimate = _submit_estimate(session, job, result, settings)
    now, lease_owner = utcnow(), job.ingest_owner  # (lock_job refreshes `job` itself: read it first)
    with write_transaction(session):
        current = lock_job(session, job.id)
        if current.ingest_owner != lease_owner:  # the rescuer failed it: this submit's lease is gone
            raise IngestLeaseLost(f"batch_{job.id}: the ingest lease expired and the job was failed")
        current.total_requests, current.failed_requests = result.total, result.invalid
        current.errors, current.num_errors = result.errors or None, result.invalid
        if current.status == JobStatus.VALIDATING:
            current.num_shards = make_shards(session, job_id=job.id, result=result,
                                             shard_size=job.shard_size, model=job.model,
                                             priority=job.priority, max_attempts=settings.max_attempts,
                                             routing=routing)
            current.status, current.in_progress_at = JobStatus.IN_PROGRESS, now
            current.estimate = estimate
            return
        # cancelled or expired while validating: the lines read since then never run either
        stop_pending(session, job=current, status=JobStatus(current.status), now=now)
        finalize_if_done(session, job=current, now=now)


def _submit_estimate(session: Session, job: Job, result: IngestResult, settings: Settings) -> dict | None:
    """The estimate shown at submit, from ingest's counts (no second tokenizing pass); None when this
    deployment's history cannot be read (the submit does not fail for it)."""
    try:
        return from_counts(session, model=job.model, requests=result.valid, invalid=result.invalid,
                           max_output=result.max_output_tokens, uncapped=result.uncapped,
                           settings=settings).as_dict()
    except SQLAlchemyError:
        logger.warning("batch_%d: no estimate at submit", job.id, exc_info=True)
        session.rollback()
        return None


def _fail_job(session: Session, job_id: int, errors: list[BatchErrorItem],
              num_errors: int | None = None) -> None:
    """Mark a job failed, dropping whatever requests ingest had written (their bytes: the owner's again)."""
    with write_transaction(session):
        session.execute(delete(Request).where(Request.job_id == job_id))
        held = session.execute(select(Job.owner, Job.request_bytes).where(Job.id == job_id)).first()
        session.execute(update(Job).where(Job.id == job_id).values(
            status=JobStatus.FAILED, failed_at=utcnow(), errors=[error.model_dump() for error in errors],
            request_bytes=0,
            num_errors=len(errors) if num_errors is None else num_errors))
        if held is not None:
            charge_storage(session, owner=held[0], delta=-held[1])


def fail_unstarted_job(session: Session, *, job_id: int, code: str, message: str) -> None:
    """Fail a job whose runner could not start (`batchinfer run`: engine load failed), nothing run yet:
    its waiting shards are cancelled and its requests dropped: it is not left in_progress for its window."""
    from batchinfer.store.models import Shard, ShardStatus

    with write_transaction(session):
        session.execute(update(Shard).where(Shard.job_id == job_id, Shard.status == ShardStatus.AVAILABLE)
                        .values(status=ShardStatus.CANCELLED, cancelled_at=utcnow()))
    _fail_job(session, job_id, [BatchErrorItem(code=code, message=message)])


def get_job(session: Session, *, job_id: int, owner: str | None = None) -> Job | None:
    """The job, or None if it does not exist (or belongs to another owner when `owner` is given)."""
    if not is_job_id(job_id):  # beyond the column's range: no such job (never a database error)
        return None
    job = session.get(Job, job_id, populate_existing=True)
    end_transaction(session)
    if job is None or (owner is not None and job.owner != owner):
        return None
    return job


def list_jobs(session: Session, *, owner: str | None = None, after: int | None = None, limit: int = 20,
              status: str | None = None) -> list[Job]:
    """Jobs newest first; `after` is the id of the last job of the previous page (cursor pagination)."""
    query = select(Job).order_by(Job.id.desc()).limit(max(1, min(limit, 1000)))
    if owner is not None:
        query = query.where(Job.owner == owner)
    if after is not None and after <= MAX_JOB_ID:  # a cursor past every id: no narrowing to do
        query = query.where(Job.id < after)
    if status is not None:
        query = query.where(Job.status == status)
    found = list(session.scalars(query))
    end_transaction(session)
    return found


def cancel_job(session: Session, *, job_id: int, owner: str | None = None) -> Job:
    """Cancel: pending requests -> canceled, idle shards -> cancelled; finished results are kept.

    The job is `cancelled` at once when no shard is running, else `cancelling` until the workers
    holding its shards let go (their heartbeat returns False). Cancelling a cancelled job returns it;
    JobNotFound when there is no such job (of `owner`), JobStateError when it already ended otherwise.
    """
    now = utcnow()
    with write_transaction(session):
        job = lock_job(session, job_id, owner=owner)
        if job.status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
            return job
        if job.status not in JOB_CANCELLABLE_STATUSES:
            raise JobStateError(f"batch_{job_id} is {job.status}; only a validating or in-progress batch can "
                                "be cancelled", status=job.status)
        stop_pending(session, job=job, status=JobStatus.CANCELLING, now=now)
        finalize_if_done(session, job=job, now=now)
    return job


def expire_jobs(session: Session, *, now: datetime | None = None) -> list[int]:
    """Expire unfinished jobs past their completion window: pending requests -> expired. Returns their ids.

    Running shards are left to their workers, whose next heartbeat answers False (as for a cancel): they
    abort the in-flight requests and hand the shard back. Single-flight (db.single_flight) and idempotent.
    """
    now = now or utcnow()
    expired: list[int] = []
    live = sorted(JOB_LIVE_STATUSES)
    with write_transaction(session):
        if not single_flight(session, EXPIRY_LOCK_KEY):  # another expirer is at it right now
            return expired
        ids = session.scalars(select(Job.id).where(Job.status.in_(live), Job.expires_at < now)).all()
        for job_id in ids:
            job = lock_job(session, job_id)
            if job.status not in JOB_LIVE_STATUSES:
                continue
            stop_pending(session, job=job, status=JobStatus.EXPIRED, now=now)
            expired.append(job_id)
    return expired
