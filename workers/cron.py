"""The schedule tick: due cron slots become jobs, finished jobs' outputs are written, webhooks delivered.

Celery beat calls `tick` every minute (task batchinfer.schedule_tick); without a broker `batchinfer
scheduler` runs the same loop in-process. Every step is safe to repeat: slots are claimed by a unique
row, job submission carries an idempotency key derived from the slot, outputs are written to a temp
file and renamed, and webhooks are delivered from an outbox table (workers.webhooks).
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

import httpx
import orjson

from batchinfer.config import Settings, get_settings
from batchinfer.store import schedules as store
from batchinfer.store.db import session_factory
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job
from batchinfer.store.models import (
    JOB_TERMINAL_STATUSES,
    JobStatus,
    Schedule,
    ScheduleRun,
    ScheduleRunStatus,
    utcnow,
)
from workers.dispatch import submit_and_announce
from workers.webhooks import deliver_webhooks, enqueue_run_webhook

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger("batchinfer.scheduler")


def tick(*, app: Celery | None = None, settings: Settings | None = None, now: datetime | None = None,
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


def run_now(*, name: str, settings: Settings | None = None, app: Celery | None = None,
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


def start_run(*, run: ScheduleRun, schedule: Schedule, settings: Settings, app: Celery | None = None,
              now: datetime | None = None) -> ScheduleRun:
    """Resolve the input file of the run's slot and submit it as a job (or record why not)."""
    sessions = session_factory(settings.effective_database_url)
    slot_local = run.slot_at.astimezone(ZoneInfo(schedule.timezone))
    pattern = store.render_template(schedule.input_template, slot_local, name=schedule.name)
    if glob.has_magic(pattern):
        matches = sorted(glob.glob(pattern))
    else:
        matches = [pattern] if Path(pattern).is_file() else []
    if not matches:
        logger.warning("schedule %s slot %s: input %s not found", schedule.name, run.slot_at, pattern)
        with sessions() as session:
            run = store.update_run(session, run_id=run.id, status=ScheduleRunStatus.FAILED,
                                   input_path=pattern, error=f"input file not found: {pattern}",
                                   finished_at=now or utcnow())
        enqueue_run_webhook(settings, run, schedule, job=None, now=now)
        return run
    path, temporary = _prepare_input(matches, schedule.params)
    try:
        with sessions() as session:
            job = submit_and_announce(
                session=session, settings=settings, app=app, path=path, model=schedule.model,
                owner=schedule.owner, idempotency_key=f"schedule-{schedule.id}-{run.slot_at.isoformat()}",
                metadata={"schedule": schedule.name, "slot": run.slot_at.isoformat()})
            job_id = job.id
    finally:
        if temporary:
            os.unlink(path)
    with sessions() as session:
        run = store.update_run(session, run_id=run.id, status=ScheduleRunStatus.SUBMITTED, job_id=job_id,
                               input_path=",".join(matches))
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
            if job is None or schedule is None or job.status not in JOB_TERMINAL_STATUSES:
                continue
            slot_local = run.slot_at.astimezone(ZoneInfo(schedule.timezone))
            output_path = errors_path = None
            if schedule.output_template:
                output_path = store.render_template(schedule.output_template, slot_local, name=schedule.name)
                write_atomically(Path(output_path), export_results(session, job_id=job.id))
            if schedule.errors_template:
                errors_path = store.render_template(schedule.errors_template, slot_local, name=schedule.name)
                write_atomically(Path(errors_path), export_results(session, job_id=job.id, kind="errors"))
        completed = job.status == JobStatus.COMPLETED
        status = ScheduleRunStatus.COMPLETED if completed else ScheduleRunStatus.FAILED
        with sessions() as session:
            run = store.update_run(session, run_id=run.id, status=status, output_path=output_path,
                                   errors_path=errors_path, finished_at=now or utcnow(),
                                   error=None if completed else f"job {job.status}")
        enqueue_run_webhook(settings, run, schedule, job=job, now=now)
        finished += 1
    return finished


def write_atomically(path: Path, lines: Iterable[bytes]) -> int:
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


def scheduler_loop(*, settings: Settings | None = None, stop: threading.Event,
                   interval_s: float = 60.0) -> None:
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
