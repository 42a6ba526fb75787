"""The Celery task bodies, registered on an app by name (the names and the app live in workers.app).

run_shard keeps this process's one engine busy; rescue and schedule_tick are beat's periodic duties and
may run in any worker (they only touch the database and the broker).
"""

from __future__ import annotations

from celery import Celery, signals

from workers import cron, process
from workers.app import RESCUE, RUN_SHARD, SCHEDULE_TICK
from workers.dispatch import rescue_and_redispatch


def register_tasks(app: Celery) -> Celery:
    """Register batchinfer's tasks on `app` (once: a second call changes nothing); returns `app`."""
    if RUN_SHARD in app.tasks:
        return app

    @app.task(name=RUN_SHARD, acks_late=True, ignore_result=True)
    def run_shard(shard_id: int) -> None:
        """Claim `shard_id` (a no-op if it is taken) and keep the engine busy until no shard is left."""
        process.run_process_shard(shard_id)

    @app.task(name=RESCUE, ignore_result=True)
    def rescue() -> int:
        """Return expired leases to the queue (single-flight in the database)."""
        return len(rescue_and_redispatch(app=app).requeued)

    @app.task(name=SCHEDULE_TICK, ignore_result=True)
    def schedule_tick() -> int:
        """Turn due schedule slots into jobs (exactly once per slot)."""
        return cron.tick(app=app)

    return app


@signals.worker_shutting_down.connect
def _on_shutdown(**_: object) -> None:
    # Warm shutdown (SIGTERM): the running shard loop stops claiming and hands its shards back.
    process.shutdown_requested.set()
