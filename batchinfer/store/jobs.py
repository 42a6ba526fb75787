"""Job service: submit, get, list, cancel, expire, finalize, record results, export, summary.

Every function takes the session first and keyword arguments after it, and leaves the session with no
open transaction (see db.end_transaction). Functions that change state commit (each is one write
transaction, `BEGIN IMMEDIATE` on SQLite); `apply_results` and `finalize_if_done` are the pieces
shards.py runs inside its own fenced transactions. Use sessions from db.session_factory
(expire_on_commit=False), so returned objects stay readable after those commits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson
from sqlalchemy import Engine, bindparam, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchinfer.formats import URL_TO_ENDPOINT, error_line, output_line, response_body, validate_metadata
from batchinfer.store.db import end_transaction, is_sqlite, write_transaction
from batchinfer.store.ingest import MAX_LISTED_ERRORS, IngestLimits, ingest_file, make_shards
from batchinfer.store.models import (
    Job,
    JobStatus,
    Request,
    RequestStatus,
    Shard,
    ShardStatus,
    request_id_for,
    utcnow,
)

OnInvalid = Literal["skip", "fail"]
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_WINDOW_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
NOT_RUN_ERRORS = {  # what the error file says for requests that never ran
    RequestStatus.CANCELED: ("batch_cancelled", "The batch was cancelled before this request ran."),
    RequestStatus.EXPIRED: ("batch_expired", "The batch expired (completion_window) before this request ran."),
}


class JobError(ValueError):
    """A job operation that is not allowed in the job's state (or a job that does not exist)."""


def _settings() -> Any:
    from batchinfer.config import get_settings

    return get_settings()


def parse_completion_window(window: str) -> timedelta:
    """'24h' -> timedelta(hours=24); accepts <n>s, <n>m, <n>h, <n>d."""
    match = _WINDOW.match(window.strip())
    if not match or int(match.group(1)) <= 0:
        raise JobError(f"completion_window {window!r} is not valid; use e.g. '24h' (units s, m, h, d)")
    return timedelta(**{_WINDOW_UNITS[match.group(2)]: int(match.group(1))})


def submit_job(
    session: Session,
    *,
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
    max_attempts: int | None = None,
) -> Job:
    """Create a job from a JSONL file (`path`, or a binary `stream`), ingest it and cut it into shards.

    Returns the job `in_progress`, or `failed` with line-numbered `errors` when the file is unusable
    (or has a bad line and on_invalid="fail"). The same (owner, idempotency_key) returns the first job.
    `endpoint` (an OpenAI url), when given, is required of every line. `priority`: lower runs first.
    """
    settings = _settings()
    if (path is None) == (stream is None):
        raise JobError("give exactly one of path= or stream=")
    if on_invalid not in ("skip", "fail"):
        raise JobError(f"on_invalid must be 'skip' or 'fail', got {on_invalid!r}")
    if endpoint is not None and endpoint not in URL_TO_ENDPOINT:
        raise JobError(f"endpoint {endpoint!r} is not supported; use one of {sorted(URL_TO_ENDPOINT)}")
    shard_size = shard_size or settings.shard_size
    if shard_size < 1:
        raise JobError(f"shard_size must be >= 1, got {shard_size}")
    limits = limits or IngestLimits(settings.max_line_bytes, settings.max_requests_per_job,
                                    settings.max_metadata_bytes)
    try:
        metadata = validate_metadata(metadata, max_bytes=limits.max_metadata_bytes)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    window = completion_window or settings.completion_window
    window_delta = parse_completion_window(window)

    if idempotency_key is not None:
        existing = _job_by_idempotency_key(session, owner, idempotency_key)
        if existing is not None:
            return existing
    file = open(path, "rb") if path is not None else None  # noqa: SIM115 - closed below; fail before creating
    now = utcnow()
    job = Job(owner=owner, model=model, endpoint=endpoint, status=JobStatus.VALIDATING,
              input_file_id=input_file_id, input_path=str(path) if path is not None else None,
              completion_window=window, priority=priority, shard_size=shard_size, on_invalid=on_invalid,
              meta=metadata, idempotency_key=idempotency_key, created_at=now, expires_at=now + window_delta)
    try:
        with write_transaction(session):
            session.add(job)
    except IntegrityError:  # a concurrent submit with the same idempotency key won
        if file is not None:
            file.close()
        existing = _job_by_idempotency_key(session, owner, idempotency_key)
        if existing is None:
            raise
        return existing
    try:
        _ingest(session, job, file or stream, limits, max_attempts or settings.max_attempts)
    except Exception as exc:
        session.rollback()
        _fail_job(session, job.id, [{"code": "ingest_error", "message": f"ingest stopped: {exc!r}",
                                     "line": None, "param": None}])
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


def _ingest(session: Session, job: Job, stream: BinaryIO, limits: IngestLimits, max_attempts: int) -> None:
    stop_after = MAX_LISTED_ERRORS if job.on_invalid == "fail" else None
    bind = session.get_bind()
    engine = bind if isinstance(bind, Engine) else bind.engine
    result = ingest_file(engine, job_id=job.id, stream=stream, limits=limits, endpoint=job.endpoint,
                         stop_after_errors=stop_after)
    if result.fatal is None and result.valid == 0:
        result.fatal = ("the file is empty" if result.total == 0 else
                        f"no valid request in {result.total} line(s); is this a JSONL batch file?")
    if result.fatal is None and result.invalid and job.on_invalid == "fail":
        result.fatal = f"{result.invalid} invalid line(s) and on_invalid='fail'; fix them or use on_invalid='skip'"
    if result.fatal is not None:
        errors = [{"code": "invalid_file", "message": result.fatal, "line": None, "param": None}, *result.errors]
        _fail_job(session, job.id, errors, num_errors=result.invalid)
        return
    now = utcnow()
    with write_transaction(session):
        current = _lock_job(session, job.id, None)
        current.total_requests, current.failed_requests = result.total, result.invalid
        current.errors, current.num_errors = result.errors or None, result.invalid
        if current.status == JobStatus.VALIDATING:
            current.num_shards = make_shards(session, job_id=job.id, result=result, shard_size=job.shard_size,
                                             model=job.model, priority=job.priority, max_attempts=max_attempts)
            current.status, current.in_progress_at = JobStatus.IN_PROGRESS, now
            return
        # cancelled or expired while validating: the lines read since then never run either
        status = RequestStatus.EXPIRED if current.status == JobStatus.EXPIRED else RequestStatus.CANCELED
        code, message = NOT_RUN_ERRORS[status]
        session.execute(update(Request).where(Request.job_id == job.id, Request.status == RequestStatus.PENDING)
                        .values(status=status, error_code=code, error_message=message, finished_at=now))
        finalize_if_done(session, job=current, now=now)


def _fail_job(session: Session, job_id: int, errors: list[dict[str, Any]], num_errors: int | None = None) -> None:
    """Mark a job failed, dropping whatever requests ingest had written."""
    with write_transaction(session):
        session.execute(delete(Request).where(Request.job_id == job_id))
        session.execute(update(Job).where(Job.id == job_id).values(
            status=JobStatus.FAILED, failed_at=utcnow(), errors=errors,
            num_errors=len(errors) if num_errors is None else num_errors))


def get_job(session: Session, *, job_id: int, owner: str | None = None) -> Job | None:
    """The job, or None if it does not exist (or belongs to another owner when `owner` is given)."""
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
    if after is not None:
        query = query.where(Job.id < after)
    if status is not None:
        query = query.where(Job.status == status)
    found = list(session.scalars(query))
    end_transaction(session)
    return found


def cancel_job(session: Session, *, job_id: int, owner: str | None = None) -> Job:
    """Cancel: pending requests -> canceled, idle shards -> cancelled; finished results are kept.

    The job is `cancelled` at once when no shard is running, else `cancelling` until the workers
    holding its shards let go (their heartbeat returns False).
    """
    now = utcnow()
    with write_transaction(session):
        job = _lock_job(session, job_id, owner)
        if job.status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
            return job
        if job.status not in (JobStatus.VALIDATING, JobStatus.IN_PROGRESS, JobStatus.FINALIZING):
            raise JobError(f"job {job_id} is {job.status}; only a validating or in-progress job can be cancelled")
        code, message = NOT_RUN_ERRORS[RequestStatus.CANCELED]
        session.execute(update(Request).where(Request.job_id == job_id, Request.status == RequestStatus.PENDING)
                        .values(status=RequestStatus.CANCELED, error_code=code, error_message=message,
                                finished_at=now))
        session.execute(update(Shard).where(Shard.job_id == job_id, Shard.status == ShardStatus.AVAILABLE)
                        .values(status=ShardStatus.CANCELLED, cancelled_at=now))
        job.status, job.cancelling_at = JobStatus.CANCELLING, now
        finalize_if_done(session, job=job, now=now)
    return job


def expire_jobs(session: Session, *, now: datetime | None = None) -> list[int]:
    """Expire unfinished jobs past their completion window: pending requests -> expired. Returns their ids."""
    now = now or utcnow()
    expired: list[int] = []
    live = (JobStatus.VALIDATING, JobStatus.IN_PROGRESS, JobStatus.FINALIZING, JobStatus.CANCELLING)
    with write_transaction(session):
        ids = session.scalars(select(Job.id).where(Job.status.in_(live), Job.expires_at < now)).all()
        code, message = NOT_RUN_ERRORS[RequestStatus.EXPIRED]
        for job_id in ids:
            job = _lock_job(session, job_id, None)
            if job.status not in live:
                continue
            session.execute(update(Request).where(Request.job_id == job_id, Request.status == RequestStatus.PENDING)
                            .values(status=RequestStatus.EXPIRED, error_code=code, error_message=message,
                                    finished_at=now))
            session.execute(update(Shard).where(Shard.job_id == job_id, Shard.status == ShardStatus.AVAILABLE)
                            .values(status=ShardStatus.CANCELLED, cancelled_at=now))
            job.status, job.expired_at = JobStatus.EXPIRED, now
            expired.append(job_id)
    return expired


def finalize_job(session: Session, *, job_id: int) -> Job:
    """Finish the job if no shard is available or running (in_progress -> completed, cancelling -> cancelled)."""
    with write_transaction(session):
        job = _lock_job(session, job_id, None)
        finalize_if_done(session, job=job, now=utcnow())
    return job


def finalize_if_done(session: Session, *, job: Job, now: datetime) -> bool:
    """In the caller's transaction: move a job with no open shard to its end state. True if it moved."""
    if job.status not in (JobStatus.IN_PROGRESS, JobStatus.FINALIZING, JobStatus.CANCELLING):
        return False
    open_shards = session.scalar(select(func.count()).select_from(Shard).where(
        Shard.job_id == job.id, Shard.status.in_((ShardStatus.AVAILABLE, ShardStatus.RUNNING))))
    if open_shards:
        return False
    if job.status == JobStatus.CANCELLING:
        job.status, job.cancelled_at = JobStatus.CANCELLED, now
    else:
        # finalizing is momentary here: results already live in the database, nothing left to assemble.
        job.status, job.finalizing_at, job.completed_at = JobStatus.COMPLETED, job.finalizing_at or now, now
    return True


def _lock_job(session: Session, job_id: int, owner: str | None) -> Job:
    query = select(Job).where(Job.id == job_id).execution_options(populate_existing=True)
    if not is_sqlite(session):
        query = query.with_for_update()
    job = session.scalar(query)
    if job is None or (owner is not None and job.owner != owner):
        raise JobError(f"job {job_id} not found")
    return job


def apply_results(session: Session, *, job: Job, results: list[dict[str, Any]], shard: Shard | None = None,
                  now: datetime | None = None) -> int:
    """In the caller's transaction: record results of still-pending requests and bump the job's counters.

    With `shard`, only that shard's requests are accepted.

    A result is {"request_id", "choices": [{"text", "finish_reason", "logprobs"?}], "prompt_tokens",
    "completion_tokens", "cached_tokens"} or {"request_id", "error": {"code", "message"}}. Results for
    requests that are no longer pending (already written, canceled) are ignored. Returns how many counted.
    """
    now = now or utcnow()
    by_id: dict[int, dict[str, Any]] = {}
    for result in results:
        _check_result(result)
        by_id.setdefault(result["request_id"], result)
    if not by_id:
        return 0
    # Only the primary key narrows this query (so no planner picks a job-wide index); job and shard
    # membership are checked on the few rows it returns.
    allowed = set(shard.request_ids) if shard is not None else None
    query = select(Request.id, Request.endpoint, Request.job_id).where(
        Request.id.in_(list(by_id)), Request.status == RequestStatus.PENDING)
    if not is_sqlite(session):
        query = query.with_for_update()  # cancel/rescue cannot flip these rows before we commit
    pending = [(row.id, row.endpoint) for row in session.execute(query)
               if row.job_id == job.id and (allowed is None or row.id in allowed)]
    created = int(now.timestamp())
    succeeded: list[dict[str, Any]] = []
    errored: list[dict[str, Any]] = []
    for request_id, endpoint in pending:
        result = by_id[request_id]
        if "error" in result:
            errored.append({"rid": request_id, "code": str(result["error"]["code"])[:64],
                            "message": str(result["error"]["message"])})
            continue
        body = response_body(endpoint=endpoint, model=job.model, request_key=request_id, created=created,
                             choices=result["choices"], prompt_tokens=result["prompt_tokens"],
                             completion_tokens=result["completion_tokens"], cached_tokens=result["cached_tokens"])
        succeeded.append({"rid": request_id, "response": orjson.dumps(body).decode(),
                          "p": result["prompt_tokens"], "c": result["completion_tokens"], "k": result["cached_tokens"]})
    table = Request.__table__
    is_mine = (table.c.id == bindparam("rid")) & (table.c.status == RequestStatus.PENDING.value)
    if succeeded:
        session.execute(table.update().where(is_mine).values(
            status=RequestStatus.SUCCEEDED.value, response=bindparam("response"), prompt_tokens=bindparam("p"),
            completion_tokens=bindparam("c"), cached_tokens=bindparam("k"), finished_at=now), succeeded)
    if errored:
        session.execute(table.update().where(is_mine).values(
            status=RequestStatus.ERRORED.value, error_code=bindparam("code"), error_message=bindparam("message"),
            finished_at=now), errored)
    if succeeded or errored:
        session.execute(update(Job).where(Job.id == job.id).values(
            completed_requests=Job.completed_requests + len(succeeded),
            failed_requests=Job.failed_requests + len(errored),
            prompt_tokens=Job.prompt_tokens + sum(r["p"] for r in succeeded),
            completion_tokens=Job.completion_tokens + sum(r["c"] for r in succeeded),
            cached_tokens=Job.cached_tokens + sum(r["k"] for r in succeeded)))
    return len(succeeded) + len(errored)


def _check_result(result: dict[str, Any]) -> None:
    rid = result.get("request_id")
    if not isinstance(rid, int):
        raise ValueError(f"result needs an integer request_id, got {rid!r}")
    if "error" in result:
        error = result["error"]
        if not (isinstance(error, dict) and "code" in error and "message" in error):
            raise ValueError(f"request {rid}: error must be {{code, message}}, got {error!r}")
        return
    choices = result.get("choices")
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, dict) and isinstance(c.get("text"), str) and "finish_reason" in c for c in choices)):
        raise ValueError(f"request {rid}: choices must be a non-empty list of {{text, finish_reason}}")
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        if not isinstance(result.get(name), int) or result[name] < 0:
            raise ValueError(f"request {rid}: {name} must be a non-negative integer, got {result.get(name)!r}")


ExportKind = Literal["output", "errors"]
_EXPORT_STATUSES = {
    "output": (RequestStatus.SUCCEEDED,),
    "errors": (RequestStatus.ERRORED, RequestStatus.CANCELED, RequestStatus.EXPIRED),
}


def export_results(session: Session, *, job_id: int, kind: ExportKind = "output",
                   chunk_size: int = 10_000) -> Iterator[bytes]:
    """Yield the OpenAI batch output (kind="output") or error file (kind="errors") lines, in input order.

    Walks the primary key (= input order) in windows of `chunk_size` lines: each query reads at most
    that many rows whatever the planner's statistics say, and no transaction stays open in between.
    """
    if kind not in _EXPORT_STATUSES:
        raise JobError(f"kind must be 'output' or 'errors', got {kind!r}")
    statuses = [s.value for s in _EXPORT_STATUSES[kind]]
    columns = (Request.id, Request.line_number, Request.custom_id, Request.status, Request.response,
               Request.error_code, Request.error_message)
    total = session.scalar(select(Job.total_requests).where(Job.id == job_id)) or 0
    end_transaction(session)
    base = request_id_for(job_id, 0)  # the job's rows are lines 1..total_requests
    dumps, fragment, newline = orjson.dumps, orjson.Fragment, orjson.OPT_APPEND_NEWLINE
    for start in range(0, total, chunk_size):
        rows = session.execute(select(*columns).where(
            Request.id > base + start, Request.id <= base + start + chunk_size, Request.status.in_(statuses))
            .order_by(Request.id)).all()
        end_transaction(session)
        for request_id, line_number, custom_id, status, response, code, message in rows:
            custom_id = custom_id if custom_id is not None else f"line-{line_number}"
            if kind == "output":
                yield dumps(output_line(request_key=request_id, custom_id=custom_id, body=fragment(response)),
                            option=newline)
            else:
                if code is None:
                    code, message = NOT_RUN_ERRORS.get(RequestStatus(status), ("unknown_error", "no detail"))
                yield dumps(error_line(request_key=request_id, custom_id=custom_id, code=code, message=message),
                            option=newline)

