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
        from workers.celery_app import create_celery_app

        app = create_celery_app(settings)
    with session_factory(settings.effective_database_url)() as session:
        shards = shard_store.list_shards(session, job_id=job_id, status=ShardStatus.AVAILABLE)
    return announce(app, shards)


def rescue_and_redispatch(*, app: Any, settings: Settings | None = None) -> int:
    """Rescue expired leases and announce the shards that went back to the queue."""
    settings = settings or get_settings()
    with session_factory(settings.effective_database_url)() as session:
        report = shard_store.rescue_expired(session)
        shards = [session.get(Shard, shard_id) for shard_id in report.requeued]
    if report.requeued or report.failed:
        logger.info("rescued shards: requeued %s, failed %s", report.requeued, report.failed)
    return announce(app, [s for s in shards if s is not None])
