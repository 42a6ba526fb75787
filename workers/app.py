"""The Celery app: Redis broker, JSON only, late acks, one message = one shard id, one queue per model.

The broker only wakes workers and routes shards to the right model's queue; the database is the source of
truth. A redelivered or duplicate message finds its shard already claimed and does nothing. This module
knows the names (tasks, queues) and the configuration; the task bodies live in workers.tasks, so code that
only sends messages (the API, the CLI, the scheduler) never imports the engine side.
"""

from __future__ import annotations

from celery import Celery

from batchinfer.config import Settings, get_settings

RUN_SHARD = "batchinfer.run_shard"
RESCUE = "batchinfer.rescue"
EXPIRE = "batchinfer.expire"
SCHEDULE_TICK = "batchinfer.schedule_tick"
PURGE = "batchinfer.purge"

# Where the periodic tasks (rescue, expire, schedule tick) go; model queues carry only run_shard. Only
# `batchinfer beat` consumes it: a model worker's solo pool is busy for a whole job at a time.
CONTROL_QUEUE = "batchinfer.control"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"


def queue_name(model: str) -> str:
    """The Celery queue that carries the shards of one model."""
    return f"batchinfer.{model}"


def beat_schedule(settings: Settings) -> dict[str, dict]:
    """The periodic tasks of a separately run `celery -A workers.celery_app beat`.

    `batchinfer beat` runs the same duties in-process instead (workers.duties) and consumes these
    messages too. Each message expires after one interval: after an outage nobody replays a backlog of
    stale ticks (the next one does the same work).
    """
    periods = {RESCUE: settings.effective_rescue_interval_s, EXPIRE: settings.expiry_sweep_seconds,
               SCHEDULE_TICK: settings.schedule_tick_seconds, PURGE: settings.purge_interval_seconds}
    return {task: {"task": task, "schedule": period, "options": {"queue": CONTROL_QUEUE, "expires": period}}
            for task, period in periods.items()}


def create_celery_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured from Settings, without task bodies (workers.tasks registers those)."""
    settings = settings or get_settings()
    app = Celery("batchinfer", broker=settings.broker_url or DEFAULT_BROKER_URL, set_as_current=False)
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
        task_default_queue=CONTROL_QUEUE,
        # Redis re-delivers unacknowledged messages after this long; a shard run may take a while.
        broker_transport_options={"visibility_timeout": 6 * 3600},
        beat_schedule=beat_schedule(settings),
        timezone="UTC",
    )
    return app


_app: Celery | None = None


def get_app() -> Celery:
    """The process's Celery app (built once from Settings, on first use)."""
    global _app
    if _app is None:
        _app = create_celery_app()
    return _app
