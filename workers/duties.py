"""The periodic duties and the loop that runs them: rescue, expiry sweep, schedule tick (with webhooks).

Every deployment shape runs them in-process, at intervals taken from Settings (ARCHITECTURE.md, section 5):

- `batchinfer beat` (with a broker) and `batchinfer scheduler` (without one): all four (purge too);
- every `batchinfer worker`: rescue and expiry, so a fleet without beat still recovers and expires; a
  Celery worker also heartbeats its registration (presence), as nothing else does between tasks.

Each duty is idempotent and single-flight in the database (an advisory lock on PostgreSQL, BEGIN IMMEDIATE
on SQLite; schedule slots are unique rows), so any number of processes may run the same duty at once. A
duty that raises (the database or broker away for a moment) is logged and runs again at its next turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchinfer.config import Settings
from batchinfer.store.db import exclusive, session_factory
from batchinfer.store.jobs import expire_jobs
from batchinfer.store.result_files import record_result_sizes
from batchinfer.store.retention import purge
from batchinfer.store.workers import WORKER_LIVE_S
from workers import cron
from workers.app import get_app
from workers.dispatch import rescue_and_redispatch
from workers.process import rescue_once

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger("batchinfer.duties")
SCHEDULE_TICK_LOCK_KEY = 0x7469636B  # advisory lock id of the schedule tick: "tick"


@dataclass(frozen=True)
class Duty:
    """A named job run every `interval_s`; `aligned` duties run at wall-clock multiples of it (cron ticks)."""

    name: str
    interval_s: float
    run: Callable[[], object]
    aligned: bool = False

    def next_run_after(self, wall_time: float) -> float:
        """The wall-clock time of the next run after one that finished at `wall_time`."""
        if self.aligned:
            return wall_time - wall_time % self.interval_s + self.interval_s
        return wall_time + self.interval_s


def rescue_duty(settings: Settings, *, app: Celery | None = None) -> Duty:
    """Expired shard leases back to the queue (announced on the broker when there is one) and dead ingests
    failed."""
    def rescue() -> None:
        if settings.broker_url:  # announce what it requeued (and wake workers for waiting shards)
            report = rescue_and_redispatch(app=app if app is not None else get_app(), settings=settings)
        else:
            report = rescue_once(settings)
        if report.requeued or report.failed or report.cancelled or report.lost_ingests:
            logger.info("rescue: requeued shards %s, failed %s, cancelled %s; failed lost ingests of jobs %s",
                        report.requeued, report.failed, report.cancelled, report.lost_ingests)

    return Duty("rescue", settings.effective_rescue_interval_s, rescue)


def expiry_duty(settings: Settings) -> Duty:
    """Jobs past their completion window expire; their workers then abort what is in flight."""

    def expire() -> None:
        with session_factory(settings.effective_database_url)() as session:
            expired = expire_jobs(session)
            for job_id in expired:  # their output / error files exist now: size them once (GET /v1/files)
                record_result_sizes(session, job_id=job_id)
        if expired:
            logger.info("expired jobs %s (completion window passed)", expired)

    return Duty("expiry", settings.expiry_sweep_seconds, expire)


def schedule_duty(settings: Settings, *, app: Celery | None = None) -> Duty:
    """Due schedule slots become jobs; finished runs get their outputs written and webhooks delivered."""
    def tick() -> None:
        # A tick spans many transactions (slots, outputs, webhook POSTs): one ticker at a time, or two
        # beats would both deliver the same webhook.
        with exclusive(settings.effective_database_url, SCHEDULE_TICK_LOCK_KEY) as mine:
            started = cron.tick(app=app, settings=settings) if mine else 0
        if started:
            logger.info("started %d scheduled run(s)", started)

    return Duty("schedule_tick", settings.schedule_tick_seconds, tick, aligned=True)


def purge_duty(settings: Settings) -> Duty:
    """Expired files and finished jobs past their retention are deleted (store.retention)."""

    def purge_expired() -> None:
        with session_factory(settings.effective_database_url)() as session:
            report = purge(session, settings=settings)
        if report.files or report.jobs:
            logger.info("purged files %s and jobs %s (expired or past retention)", report.files, report.jobs)

    return Duty("purge", settings.purge_interval_seconds, purge_expired)


def presence_duty(heartbeat: Callable[[], object]) -> Duty:
    """An idle Celery worker's heartbeat: between tasks nothing else marks it live (a busy one beats)."""
    return Duty("presence", WORKER_LIVE_S / 4, heartbeat)


def control_duties(settings: Settings, *, app: Celery | None = None) -> list[Duty]:
    """What `batchinfer beat` and `batchinfer scheduler` run: every duty."""
    return [rescue_duty(settings, app=app), expiry_duty(settings), schedule_duty(settings, app=app),
            purge_duty(settings)]


def worker_duties(settings: Settings, *, app: Celery | None = None) -> list[Duty]:
    """What every `batchinfer worker` runs beside its shards: rescue and expiry."""
    return [rescue_duty(settings, app=app), expiry_duty(settings)]


def run_duties(duties: Sequence[Duty], *, stop: threading.Event) -> None:
    """Run each duty at once, then every interval, until `stop` is set (a failing duty waits its turn)."""
    next_at = {duty.name: 0.0 for duty in duties}
    while not stop.is_set():
        for duty in duties:
            if time.time() >= next_at[duty.name] and not stop.is_set():
                try:
                    duty.run()
                except Exception:  # a bad pass must not end the loop: the next one retries
                    logger.exception("periodic duty %s failed; retrying in %.1fs", duty.name, duty.interval_s)
                next_at[duty.name] = duty.next_run_after(time.time())
        stop.wait(max(0.0, min(next_at.values()) - time.time()))


def start_duties(duties: Sequence[Duty], *, stop: threading.Event) -> threading.Thread:
    """run_duties on a daemon thread (it dies with the process, as a killed worker's duties should)."""
    thread = threading.Thread(target=run_duties, args=(duties,), kwargs={"stop": stop},
                              name="batchinfer-duties", daemon=True)
    thread.start()
    return thread
