"""The schedule tick: due cron slots become jobs, finished jobs' outputs are written, webhooks delivered.

Celery beat calls `tick` every minute (task batchinfer.schedule_tick); without a broker `batchinfer
scheduler` runs the same loop in-process. Every step is safe to repeat: slots are claimed by a unique
row, job submission carries an idempotency key derived from the slot, outputs are written to a temp
file and renamed, and webhooks are delivered from an outbox table (workers.webhooks). A run still
`pending` STALE_PENDING_RUN after its claim (the ticker died before submitting it) is started again: the
slot's idempotency key returns the job if the dead ticker had created it.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

import httpx
import orjson

from batchinfer.config import Settings, get_settings
from batchinfer.destinations import check_schedule_path, schedule_roots
from batchinfer.store import LOCAL_OWNER
from batchinfer.store import schedules as store
from batchinfer.store.db import session_factory
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job
from batchinfer.store.models import (
    JOB_TERMINAL_STATUSES,
    Job,
    JobStatus,
    Schedule,
    ScheduleRun,
    ScheduleRunStatus,
    utcnow,
)
from batchinfer.wire.json_types import JSONObject
from workers.dispatch import submit_and_announce
from workers.webhooks import deliver_webhooks, enqueue_run_webhook

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger("batchinfer.scheduler")
# Longer than any submit takes to start (a tick submits its runs one after the other, under its lock).
STALE_PENDING_RUN = timedelta(minutes=5)


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
        try:  # one schedule's trouble never keeps the others (or the outputs and webhooks) waiting
            to_run, latest = store.due_slots(schedule, now=now)
            for slot in to_run:
                with sessions() as session:
                    run = store.claim_slot(session, schedule=schedule, slot_at=slot, now=now)
                if run is not None:
                    start_run(run=run, schedule=schedule, settings=settings, app=app, now=now)
                    started += 1
            if latest is not None:
                with sessions() as session:
                    store.mark_skipped_slots(session, schedule=schedule, up_to=latest)
        except Exception:
            logger.exception("schedule %s: could not start its due slots; retrying at the next tick",
                             schedule.name)
    started += restart_stale_runs(settings=settings, app=app, now=now)
    finish_runs(settings=settings, now=now)
    deliver_webhooks(settings=settings, now=now, client=client)
    return started


def restart_stale_runs(*, settings: Settings, app: Celery | None = None, now: datetime | None = None) -> int:
    """Start again the runs claimed but never submitted (their ticker died in between); returns how many."""
    now = now or utcnow()
    sessions = session_factory(settings.effective_database_url)
    with sessions() as session:
        runs = store.stale_pending_runs(session, claimed_before=now - STALE_PENDING_RUN)
        schedules = {s.id: s for s in store.list_schedules(session)}
    restarted = 0
    for run in runs:
        schedule = schedules.get(run.schedule_id)
        if schedule is None:
            continue
        logger.warning("schedule %s slot %s: its run was claimed at %s but never submitted; starting it",
                       schedule.name, run.slot_at, run.created_at)
        start_run(run=run, schedule=schedule, settings=settings, app=app, now=now)
        restarted += 1
    return restarted


def run_now(*, name: str, settings: Settings | None = None, app: Celery | None = None,
            now: datetime | None = None) -> ScheduleRun:
    """Start a manual run of a schedule for the current time (it does not move the cron slots)."""
    settings = settings or get_settings()
    now = now or utcnow()
    with session_factory(settings.effective_database_url)() as session:
        schedule = store.get_schedule(session, name=name)
        run = store.claim_slot(session, schedule=schedule, slot_at=now, manual=True, now=now)
    if run is None:
        raise store.ScheduleError(f"a run of {name!r} for {now.isoformat()} exists already; try again")
    return start_run(run=run, schedule=schedule, settings=settings, app=app, now=now)


def start_run(*, run: ScheduleRun, schedule: Schedule, settings: Settings, app: Celery | None = None,
              now: datetime | None = None) -> ScheduleRun:
    """Resolve the input file of the run's slot and submit it as a job, or fail the run saying why.

    Never raises for a problem of this run (no input, only directories matched, unreadable input, a
    refused submit): the run is `failed` with the reason and its webhook queued, so it can neither stay
    `pending` nor stop the tick from starting other runs.
    """
    sessions = session_factory(settings.effective_database_url)
    pattern = schedule.input_template
    try:
        slot_local = run.slot_at.astimezone(ZoneInfo(schedule.timezone))
        pattern = store.render_template(schedule.input_template, slot_local, name=schedule.name)
        matches, directories = _input_files(pattern)
        for match in matches:  # each file, symlinks followed: inside schedule_roots (batchinfer.destinations)
            check_schedule_path(match, schedule_roots(settings), field="input")
        if not matches:
            error = f"input file not found: {pattern}"
            if directories:
                error += f" (it matched only directories, which are skipped: {', '.join(directories[:5])})"
            logger.warning("schedule %s slot %s: %s", schedule.name, run.slot_at, error)
            return _fail_run(run, schedule, settings=settings, now=now, input_path=pattern, error=error)
        if directories:
            logger.warning("schedule %s slot %s: skipped directories matching %s: %s", schedule.name,
                           run.slot_at, pattern, ", ".join(directories[:5]))
        path, temporary = _prepare_input(matches, schedule.params)
        try:
            with sessions() as session:
                job = submit_and_announce(
                    session=session, settings=settings, app=app, path=path, model=schedule.model,
                    owner=schedule.owner or LOCAL_OWNER,  # schedules made before owners were set
                    idempotency_key=f"schedule-{schedule.id}-{run.slot_at.isoformat()}",
                    metadata={"schedule": schedule.name, "slot": run.slot_at.isoformat()},
                    result_cache=schedule.result_cache)  # None: the setting's default
                job_id = job.id
        finally:
            if temporary:
                os.unlink(path)
    except Exception as exc:  # this run's problem only: record it, the tick goes on
        logger.exception("schedule %s slot %s: could not start the run", schedule.name, run.slot_at)
        return _fail_run(run, schedule, settings=settings, now=now, input_path=pattern,
                         error=f"could not submit {pattern}: {exc}")
    with sessions() as session:
        run = store.update_run(session, run_id=run.id, status=ScheduleRunStatus.SUBMITTED, job_id=job_id,
                               input_path=",".join(matches))
    logger.info("schedule %s slot %s: submitted batch_%s", schedule.name, run.slot_at, job_id)
    return run


def _input_files(pattern: str) -> tuple[list[str], list[str]]:
    """(files the input pattern names, directories it matched and that are skipped), each sorted."""
    paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    files = [path for path in paths if Path(path).is_file()]
    return files, [path for path in paths if Path(path).is_dir()]


def _fail_run(run: ScheduleRun, schedule: Schedule, *, settings: Settings, error: str,
              now: datetime | None = None, job: Job | None = None, **values: object) -> ScheduleRun:
    """Record a run as failed with `error` and queue its webhook (status failed)."""
    with session_factory(settings.effective_database_url)() as session:
        run = store.update_run(session, run_id=run.id, status=ScheduleRunStatus.FAILED, error=error,
                               finished_at=now or utcnow(), **values)
    enqueue_run_webhook(settings, run, schedule, job=job, now=now)
    return run


def _prepare_input(matches: list[str], defaults: JSONObject | None) -> tuple[str, bool]:
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


def _with_defaults(line: bytes, defaults: JSONObject) -> bytes:
    """Add default sampling fields a line does not set (bad lines pass through for ingest to report)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return line
    if not isinstance(obj, dict):
        return line
    body = obj.get("body")
    target = body if isinstance(body, dict) else obj
    for key, value in defaults.items():
        target.setdefault(key, value)
    return orjson.dumps(obj) + b"\n"


def finish_runs(*, settings: Settings, now: datetime | None = None) -> int:
    """Write outputs of runs whose job ended (atomically) and queue their webhooks; returns runs finished.

    A run whose outputs cannot be written (a directory it may not write, a full disk, a bad template)
    fails alone, with the reason on the run and in its webhook; the other runs are finished as usual.
    """
    sessions = session_factory(settings.effective_database_url)
    finished = 0
    with sessions() as session:
        runs = store.runs_awaiting_outputs(session)
    for run in runs:
        try:
            finished += _finish_run(run, settings=settings, now=now)
        except Exception:  # e.g. the database went away: this run is retried at the next tick
            logger.exception("schedule run %s: could not be finished; retrying at the next tick", run.id)
    return finished


def _finish_run(run: ScheduleRun, *, settings: Settings, now: datetime | None) -> int:
    """Finish one run whose job ended: outputs, status, webhook. Returns 1 if it finished, 0 if not yet."""
    output_path = errors_path = target = None
    error: str | None = None
    with session_factory(settings.effective_database_url)() as session:
        job = get_job(session, job_id=run.job_id) if run.job_id is not None else None
        schedule = session.get(Schedule, run.schedule_id)
        if schedule is None or (job is not None and job.status not in JOB_TERMINAL_STATUSES):
            return 0  # not done yet (or the schedule was removed meanwhile, its runs with it)
        if job is None:
            error = f"job batch_{run.job_id} no longer exists; there are no results to write"
        else:
            try:
                slot_local = run.slot_at.astimezone(ZoneInfo(schedule.timezone))
                if schedule.output_template:  # each path is recorded once its file is written
                    target = store.render_template(schedule.output_template, slot_local, name=schedule.name)
                    write_atomically(_confined(target, settings), export_results(session, job_id=job.id))
                    output_path = target
                if schedule.errors_template:
                    target = store.render_template(schedule.errors_template, slot_local, name=schedule.name)
                    write_atomically(_confined(target, settings),
                                     export_results(session, job_id=job.id, kind="errors"))
                    errors_path = target
            except (OSError, ValueError, KeyError, IndexError) as exc:
                logger.warning("schedule %s run %s: cannot write %s: %s", schedule.name, run.id, target, exc)
                error = (f"job {job.status}, but its results could not be written to {target}: {exc} (they "
                         f"stay in the database: `batchinfer results {job.batch_id} -o FILE`)")
    if error is None and job is not None and job.status != JobStatus.COMPLETED:
        error = f"job {job.status}"
    status = ScheduleRunStatus.FAILED if error is not None else ScheduleRunStatus.COMPLETED
    with session_factory(settings.effective_database_url)() as session:
        run = store.update_run(session, run_id=run.id, status=status, output_path=output_path,
                               errors_path=errors_path, finished_at=now or utcnow(), error=error)
    enqueue_run_webhook(settings, run, schedule, job=job, now=now)
    return 1


def _confined(target: str, settings: Settings) -> Path:
    """An output path, once checked to lie in schedule_roots (DestinationRefused, a ValueError, if not)."""
    check_schedule_path(target, schedule_roots(settings), field="output")
    return Path(target)


def new_file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the process umask (read without changing it on Linux,
    where another thread may be creating files meanwhile)."""
    try:
        with open("/proc/self/status") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def write_atomically(path: Path, lines: Iterable[bytes]) -> int:
    """Write lines to a temp file beside `path`, fsync, then rename: readers see all of it or nothing.

    The file gets an ordinary file's mode (new_file_mode), not the temp file's private 0600.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    count = 0
    try:
        os.fchmod(fd, new_file_mode())
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
