"""Announce shards on the broker: one message per shard, carrying only its id, on its model's queue."""

from __future__ import annotations

import logging
from typing import Any

from batchinfer.config import Settings, get_settings
from batchinfer.store import shards as shard_store
from batchinfer.store.db import session_factory
from batchinfer.store.models import Shard, ShardStatus

logger = logging.getLogger("batchinfer.workers")


def announce(app: Any, shards: list[Shard]) -> int:
    """Send one run_shard message per shard to `batchinfer.<model>`."""
    from workers.celery_app import RUN_SHARD, queue_name

    for shard in shards:
        app.send_task(RUN_SHARD, args=[shard.id], queue=queue_name(shard.model))
    return len(shards)


def dispatch_job(*, job_id: int, settings: Settings | None = None, app: Any = None) -> int:
    """Announce the job's available shards when a broker is configured; 0 in local mode."""
    settings = settings or get_settings()
    if not settings.broker_url:
        return 0
    if app is None:
        from workers.celery_app import get_app

        app = get_app()
    with session_factory(settings.effective_database_url)() as session:
        shards = shard_store.list_shards(session, job_id=job_id, status=ShardStatus.AVAILABLE)
    return announce(app, shards)


def rescue_and_redispatch(*, app: Any, settings: Settings | None = None,
                          wake_per_model: int = 2) -> shard_store.RescueReport:
    """Rescue expired leases, then announce the requeued shards and wake workers for waiting ones.

    Announcing is idempotent (a taken shard ignores its message), and it covers messages the broker lost
    (a Redis restart without persistence): each model with available shards gets a few wake-up messages,
    and a woken worker claims the rest from the database itself.
    """
    settings = settings or get_settings()
    with session_factory(settings.effective_database_url)() as session:
        report = shard_store.rescue_expired(session)
        requeued = [s for s in (session.get(Shard, shard_id) for shard_id in report.requeued) if s is not None]
        waiting = shard_store.available_shards_per_model(session, limit_per_model=wake_per_model)
    if report.requeued or report.failed:
        logger.info("rescued shards: requeued %s, failed %s", report.requeued, report.failed)
    seen = {s.id for s in requeued}
    announce(app, requeued + [s for s in waiting if s.id not in seen])
    return report
