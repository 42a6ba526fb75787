"""The schedule tick: due cron slots become jobs, finished jobs' outputs are written, webhooks delivered.

Celery beat calls `tick` every minute (task batchinfer.schedule_tick); without a broker `batchinfer
scheduler` runs the same loop in-process. Every step is safe to repeat: slots are claimed by a unique
row, job submission carries an idempotency key derived from the slot, outputs are written to a temp
file and renamed, and webhooks are delivered from an outbox table until one attempt succeeds.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import logging
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import orjson

from batchinfer.config import Settings, get_settings
from batchinfer.store import schedules as store
from batchinfer.store.db import session_factory
from batchinfer.store.jobs import export_results, get_job, submit_job
from batchinfer.store.models import Schedule, ScheduleRun, ScheduleRunStatus, utcnow

logger = logging.getLogger("batchinfer.scheduler")

SIGNATURE_HEADER = "X-Batchinfer-Signature"
TIMESTAMP_HEADER = "X-Batchinfer-Timestamp"
WEBHOOK_MAX_ATTEMPTS = 8
WEBHOOK_BASE_DELAY_S = 30.0
_FINISHED_JOB = {"completed", "failed", "cancelled", "expired"}


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header value: sha256=HMAC-SHA256(secret, "<timestamp>.<body>") in hex."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """Check a webhook signature in constant time (what a receiver does)."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


def tick(*, app: Any = None, settings: Settings | None = None, now: datetime | None = None,
         client: httpx.Client | None = None) -> int:
    """One pass: start due slots, finish runs whose job ended, deliver due webhooks; returns runs started."""
    settings = settings or get_settings()
    now = now or utcnow()
    sessions = session_factory(settings.effective_database_url)
    started = 0
    with sessions() as session:
        schedules = [s for s in store.list_schedules(session) if s.enabled]
    for schedule in schedules:
        to_run, latest = store.due_slots(schedule, now=now)
        for slot in to_run:
            with sessions() as session:
                run = store.claim_slot(session, schedule=schedule, slot_at=slot)
            if run is not None:
                start_run(run=run, schedule=schedule, settings=settings, app=app, now=now)
                started += 1
        if latest is not None:
            with sessions() as session:
                store.mark_skipped_slots(session, schedule=schedule, up_to=latest)
    finish_runs(settings=settings, now=now)
    deliver_webhooks(settings=settings, now=now, client=client)
    return started


def run_now(*, name: str, settings: Settings | None = None, app: Any = None,
            now: datetime | None = None) -> ScheduleRun:
    """Start a manual run of a schedule for the current time (it does not move the cron slots)."""
    settings = settings or get_settings()
    now = now or utcnow()
    with session_factory(settings.effective_database_url)() as session:
        schedule = store.get_schedule(session, name=name)
        run = store.claim_slot(session, schedule=schedule, slot_at=now, manual=True)
    if run is None:
        raise store.ScheduleError(f"a run of {name!r} for {now.isoformat()} exists already; try again")
    return start_run(run=run, schedule=schedule, settings=settings, app=app, now=now)


def start_run(*, run: ScheduleRun, schedule: Schedule, settings: Settings, app: Any = None,
              now: datetime | None = None) -> ScheduleRun:
    """Resolve the input file of the run's slot and submit it as a job (or record why not)."""
    sessions = session_factory(settings.effective_database_url)
    slot_local = run.slot_at.astimezone(ZoneInfo(schedule.timezone))
    pattern = store.render_template(schedule.input_template, slot_local, name=schedule.name)
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else ([pattern] if Path(pattern).is_file() else [])
    if not matches:
        logger.warning("schedule %s slot %s: input %s not found", schedule.name, run.slot_at, pattern)
        with sessions() as session:
            run = store.update_run(session, run_id=run.id, status=ScheduleRunStatus.FAILED, input_path=pattern,
                                   error=f"input file not found: {pattern}", finished_at=now or utcnow())
        _enqueue_webhook(settings, run, schedule, job=None, now=now)
        return run
    path, temporary = _prepare_input(matches, schedule.params)
    try:
        with sessions() as session:
            job = submit_job(session, path=path, model=schedule.model, owner=schedule.owner,
                             idempotency_key=f"schedule-{schedule.id}-{run.slot_at.isoformat()}",
                             metadata={"schedule": schedule.name, "slot": run.slot_at.isoformat()})
            job_id, status = job.id, job.status
    finally:
        if temporary:
            os.unlink(path)
    with sessions() as session:
        run = store.update_run(session, run_id=run.id, status=ScheduleRunStatus.SUBMITTED, job_id=job_id,
                               input_path=",".join(matches))
    if status == "in_progress" and settings.broker_url:
        from workers.dispatch import dispatch_job

        dispatch_job(job_id=job_id, settings=settings, app=app)
    logger.info("schedule %s slot %s: submitted job %s", schedule.name, run.slot_at, job_id)
    return run


def _prepare_input(matches: list[str], defaults: dict[str, Any] | None) -> tuple[str, bool]:
    """One file to submit: the match itself, or a temp file joining matches and filling default params."""
    if len(matches) == 1 and not defaults:
        return matches[0], False
    fd, tmp = tempfile.mkstemp(suffix=".jsonl", prefix="batchinfer-schedule-")
    with os.fdopen(fd, "wb") as out:
        for match in matches:
            with open(match, "rb") as lines:
                for line in lines:
                    out.write(_with_defaults(line, defaults) if defaults else line)
                    if not line.endswith(b"\n"):
                        out.write(b"\n")
    return tmp, True


def _with_defaults(line: bytes, defaults: dict[str, Any]) -> bytes:
    """Add default sampling fields a line does not set (bad lines pass through for ingest to report)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return line
    if not isinstance(obj, dict):
        return line
    target = obj.get("body") if isinstance(obj.get("body"), dict) else obj
    for key, value in defaults.items():
        target.setdefault(key, value)
    return orjson.dumps(obj) + b"\n"


def finish_runs(*, settings: Settings, now: datetime | None = None) -> int:
    """Write outputs of runs whose job ended (atomically) and queue their webhooks; returns runs finished."""
    sessions = session_factory(settings.effective_database_url)
    finished = 0
    with sessions() as session:
        runs = store.runs_awaiting_outputs(session)
    for run in runs:
        with sessions() as session:
            job = get_job(session, job_id=run.job_id)
            schedule = session.get(Schedule, run.schedule_id)
            if job is None or schedule is None or job.status not in _FINISHED_JOB:
                continue
            slot_local = run.slot_at.astimezone(ZoneInfo(schedule.timezone))
            output_path = errors_path = None
            if schedule.output_template:
                output_path = store.render_template(schedule.output_template, slot_local, name=schedule.name)
                write_atomically(Path(output_path), export_results(session, job_id=job.id))
            if schedule.errors_template:
                errors_path = store.render_template(schedule.errors_template, slot_local, name=schedule.name)
                write_atomically(Path(errors_path), export_results(session, job_id=job.id, kind="errors"))
        status = ScheduleRunStatus.COMPLETED if job.status == "completed" else ScheduleRunStatus.FAILED
        with sessions() as session:
            run = store.update_run(session, run_id=run.id, status=status, output_path=output_path,
                                   errors_path=errors_path, finished_at=now or utcnow(),
                                   error=None if status == ScheduleRunStatus.COMPLETED else f"job {job.status}")
        _enqueue_webhook(settings, run, schedule, job=job, now=now)
        finished += 1
    return finished


def write_atomically(path: Path, lines: Any) -> int:
    """Write lines to a temp file beside `path`, fsync, then rename: readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    count = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for line in lines:
                out.write(line)
                count += 1
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return count


def _enqueue_webhook(settings: Settings, run: ScheduleRun, schedule: Schedule, *, job: Any,
                     now: datetime | None = None) -> None:
    if not schedule.webhook_url:
        return
    payload = {
        "schedule": schedule.name,
        "slot": run.slot_at.isoformat(),
        "run_id": run.id,
        "status": str(run.status),
        "error": run.error,
        "job_id": job.batch_id if job is not None else None,
        "job_status": str(job.status) if job is not None else None,
        "request_counts": job.request_counts if job is not None else None,
        "usage": job.usage if job is not None else None,
        "output_path": run.output_path,
        "errors_path": run.errors_path,
    }
    with session_factory(settings.effective_database_url)() as session:
        store.enqueue_webhook(session, run=run, url=schedule.webhook_url, payload=orjson.dumps(payload), now=now)


def deliver_webhooks(*, settings: Settings, now: datetime | None = None, client: httpx.Client | None = None) -> int:
    """POST due webhooks with their signature; failures are retried later with backoff. Returns delivered."""
    now = now or utcnow()
    sessions = session_factory(settings.effective_database_url)
    with sessions() as session:
        due = [(d.id, d.url, d.payload.encode(), _secret(session, d.run_id)) for d in store.due_webhooks(session, now=now)]
    if not due:
        return 0
    owns_client = client is None
    client = client or httpx.Client(timeout=10.0)
    delivered = 0
    try:
        for delivery_id, url, body, secret in due:
            timestamp = str(int(time.time()))
            headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: timestamp}
            if secret:
                headers[SIGNATURE_HEADER] = sign(secret, timestamp, body)
            try:
                response = client.post(url, content=body, headers=headers)
                ok, error = response.is_success, None if response.is_success else f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"
            with sessions() as session:
                store.record_webhook_attempt(session, delivery_id=delivery_id, ok=ok, error=error, now=now,
                                             max_attempts=WEBHOOK_MAX_ATTEMPTS, base_delay_s=WEBHOOK_BASE_DELAY_S)
            delivered += ok
    finally:
        if owns_client:
            client.close()
    return delivered


def _secret(session: Any, run_id: int) -> str | None:
    run = session.get(ScheduleRun, run_id)
    schedule = session.get(Schedule, run.schedule_id) if run is not None else None
    return schedule.webhook_secret if schedule is not None else None


def scheduler_loop(*, settings: Settings | None = None, stop: Any, interval_s: float = 60.0) -> None:
    """`batchinfer scheduler`: tick once a minute (at the minute) until `stop` is set."""
    settings = settings or get_settings()
    while not stop.is_set():
        try:
            started = tick(settings=settings)
            if started:
                logger.info("started %d scheduled run(s)", started)
        except Exception:  # a bad tick must not end the scheduler
            logger.exception("schedule tick failed")
        stop.wait(interval_s - (time.time() % interval_s))
