"""The Celery app: Redis broker, JSON only, late acks, one message = one shard id, one queue per model.

The broker only wakes workers and routes shards to the right model's queue; the database is the source of
truth. A redelivered or duplicate message finds its shard already claimed and does nothing.
"""

from __future__ import annotations

import logging
import threading

from celery import Celery, signals

from batchinfer.config import Settings, get_settings

logger = logging.getLogger("batchinfer.workers")

RUN_SHARD = "batchinfer.run_shard"
RESCUE = "batchinfer.rescue"
SCHEDULE_TICK = "batchinfer.schedule_tick"

# Set when the worker begins a warm shutdown (SIGTERM): runners stop claiming and hand shards back.
shutdown_requested = threading.Event()


def queue_name(model: str) -> str:
    """The Celery queue that carries the shards of one model."""
    return f"batchinfer.{model}"


def create_celery_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured from Settings (broker_url must be set)."""
    settings = settings or get_settings()
    app = Celery("batchinfer", broker=settings.broker_url or "redis://127.0.0.1:6379/0", set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        # A shard is acknowledged only after it ran, so a crashed worker's message is delivered again;
        # the lease in the database makes that redelivery harmless.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        task_default_queue="batchinfer.control",
        # Redis re-delivers unacknowledged messages after this long; a shard run may take a while.
        broker_transport_options={"visibility_timeout": 6 * 3600},
        beat_schedule={
            "rescue-expired-shards": {"task": RESCUE, "schedule": max(5.0, settings.lease_seconds / 4)},
            "schedule-tick": {"task": SCHEDULE_TICK, "schedule": 60.0},
        },
        timezone="UTC",
    )
    _register_tasks(app)
    return app


def _register_tasks(app: Celery) -> None:
    @app.task(name=RUN_SHARD, acks_late=True, ignore_result=True)
    def run_shard(shard_id: str) -> None:
        """Claim `shard_id` (a no-op if it is taken) and keep the engine busy until no shard is left."""
        from workers.local import process_worker

        process_worker().work(first_shard_id=shard_id, stop=shutdown_requested)

    @app.task(name=RESCUE, ignore_result=True)
    def rescue() -> int:
        """Return expired leases to the queue (single-flight in the database)."""
        from workers.dispatch import rescue_and_redispatch

        return len(rescue_and_redispatch(app=app).requeued)

    @app.task(name=SCHEDULE_TICK, ignore_result=True)
    def schedule_tick() -> int:
        """Turn due schedule slots into jobs (exactly once per slot)."""
        from workers.scheduling import tick

        return tick(app=app)


@signals.worker_shutting_down.connect
def _on_shutdown(**_: object) -> None:
    shutdown_requested.set()


_app: Celery | None = None


def get_app() -> Celery:
    """The process's Celery app (built once from Settings)."""
    global _app
    if _app is None:
        _app = create_celery_app()
    return _app


def __getattr__(name: str) -> Celery:
    # `celery -A workers.celery_app` looks up `app`; build it only then, never at import.
    if name == "app":
        return get_app()
    raise AttributeError(name)
