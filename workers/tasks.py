"""The Celery task bodies, registered on an app by name (the names and the app live in workers.app).

run_shard keeps this process's one engine busy. rescue, expire and schedule_tick are the periodic duties
(workers.duties) as tasks on the control queue, for a separately run `celery beat`; `batchinfer beat`
consumes them (and runs the same duties in-process anyway). They only touch the database and the broker.

A parallel engine that lost a rank (RankFailedError) cannot run another step: run_shard has handed its
shards back by then, and the worker process exits with EXIT_ENGINE_LOST (its unacknowledged message goes
back to the queue) so that a supervisor restarts it, rather than consuming shards it cannot run.
"""

from __future__ import annotations

import logging
import os

from celery import Celery, signals

from batchinfer.config import get_settings
from batchinfer.engine.errors import RankFailedError
from batchinfer.store.db import session_factory
from batchinfer.store.jobs import expire_jobs
from workers import process
from workers.app import EXPIRE, PURGE, RESCUE, RUN_SHARD, SCHEDULE_TICK
from workers.dispatch import rescue_and_redispatch, wake_waiting
from workers.duties import purge_duty, schedule_duty

logger = logging.getLogger("batchinfer.workers")
EXIT_ENGINE_LOST = 3


def register_tasks(app: Celery) -> Celery:
    """Register batchinfer's tasks on `app` (once: a second call changes nothing); returns `app`."""
    if RUN_SHARD in app.tasks:
        return app

    @app.task(name=RUN_SHARD, acks_late=True, ignore_result=True)
    def run_shard(shard_id: int) -> None:
        """Claim `shard_id` (a no-op if it is taken) and keep the engine busy until no shard is left."""
        try:
            stats = process.run_process_shard(shard_id)
        except RankFailedError as exc:
            logger.critical("the engine lost a rank (%s); its shards were handed back; exiting", exc)
            try:
                wake_waiting(app=app)
            except Exception:  # the broker is away too: the periodic rescue announces them
                logger.warning("could not announce the shards handed back", exc_info=True)
            logging.shutdown()
            os._exit(EXIT_ENGINE_LOST)  # from a task, sys.exit would only fail the task
        if stats.shards_released:  # a warm shutdown handed shards back: wake the workers that stay
            try:
                wake_waiting(app=app)
            except Exception:  # the broker is away: the periodic rescue wakes them instead
                logger.warning("could not announce the shards handed back", exc_info=True)

    @app.task(name=RESCUE, ignore_result=True)
    def rescue() -> int:
        """Return expired leases to the queue (single-flight in the database)."""
        return len(rescue_and_redispatch(app=app).requeued)

    @app.task(name=EXPIRE, ignore_result=True)
    def expire() -> int:
        """Expire jobs past their completion window (single-flight in the database)."""
        with session_factory(get_settings().effective_database_url)() as session:
            return len(expire_jobs(session))

    @app.task(name=SCHEDULE_TICK, ignore_result=True)
    def schedule_tick() -> None:
        """Turn due schedule slots into jobs (exactly once per slot), one ticker at a time."""
        schedule_duty(get_settings(), app=app).run()

    @app.task(name=PURGE, ignore_result=True)
    def purge() -> None:
        """Delete expired files and finished jobs past their retention (store.retention)."""
        purge_duty(get_settings()).run()

    return app


@signals.worker_shutting_down.connect
def _on_shutdown(**_: object) -> None:
    # Warm shutdown (SIGTERM): the running shard loop stops claiming and hands its shards back.
    process.shutdown_requested.set()
