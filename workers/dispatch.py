"""Announce shards on the broker: one message per shard, carrying only its id, on its model's queue.

Announcing only wakes workers; the database decides who runs what (ARCHITECTURE.md, contract 9). So
announcing twice is harmless (a taken shard ignores its message) and a lost announcement is repaired by
`rescue_and_redispatch`, the rescue duty that `batchinfer beat` and every worker run (workers.duties).

Wake-ups (rescue's, and after a worker handed shards back) go only to a model queue holding no message yet:
one waiting message already wakes a worker that claims every available shard of its model from the
database, and a model no worker serves would otherwise gather a few more messages every pass, forever.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from batchinfer.config import Settings, get_settings
from batchinfer.store import shards as shard_store
from batchinfer.store.db import session_factory
from batchinfer.store.jobs import submit_job
from batchinfer.store.models import Job, JobStatus, Shard, ShardStatus
from workers.app import RUN_SHARD, get_app, queue_name

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger("batchinfer.workers")
MAX_ANNOUNCED_PER_JOB = 256  # wake-up messages a submit sends: one per shard, up to this many workers


def announce(app: Celery, shards: Iterable[Shard]) -> int:
    """Send one run_shard message per shard to its model's queue; returns the messages sent."""
    sent = 0
    for shard in shards:
        app.send_task(RUN_SHARD, args=[shard.id], queue=queue_name(shard.model))
        sent += 1
    return sent


def waiting_messages(app: Celery, model: str) -> int:
    """Messages waiting (not yet taken by a worker) on the model's queue; 0 when the queue does not exist."""
    from kombu.exceptions import ChannelError

    with app.connection_for_write() as connection:
        try:  # passive: ask the broker (Redis: LLEN over the priority lists), never create the queue
            declared = connection.default_channel.queue_declare(queue=queue_name(model), passive=True)
            return declared.message_count
        except ChannelError:  # no such queue: nothing waits on it
            return 0


def wake(app: Celery, shards: Iterable[Shard]) -> int:
    """Announce `shards` on their models' queues, skipping every model whose queue already holds a message
    (it wakes a worker that claims the rest from the database); returns the messages sent."""
    by_model: dict[str, list[Shard]] = {}
    for shard in shards:
        by_model.setdefault(shard.model, []).append(shard)
    quiet = [group for model, group in by_model.items() if waiting_messages(app, model) == 0]
    return announce(app, [shard for group in quiet for shard in group])


def announce_job(*, session: Session, job_id: int, app: Celery) -> int:
    """Announce the job's available shards (at most MAX_ANNOUNCED_PER_JOB); returns the messages sent.

    A message only wakes a worker, which then claims shard after shard from the database until none is
    left; so a job of 25,000 shards needs no 25,000 messages (seconds of broker round trips in the submit).
    Workers beyond that many are woken by the periodic rescue's wake-ups.
    """
    available = shard_store.list_shards(session, job_id=job_id, status=ShardStatus.AVAILABLE)
    return announce(app, available[:MAX_ANNOUNCED_PER_JOB])


def submit_and_announce(*, session: Session, settings: Settings, app: Celery | None = None,
                        **submit_args: Any) -> Job:
    """Submit a job (the rest of store.jobs.submit_job's arguments), then wake its model's workers.

    Announcing happens only with a broker configured and a job that is `in_progress` (local-mode workers
    poll the database instead). The job is committed before it is announced, so a broker failure here is
    logged, not raised: the job stands, and rescue_and_redispatch announces its waiting shards later.
    """
    job = submit_job(session, settings=settings, **submit_args)
    if job.status != JobStatus.IN_PROGRESS or not settings.broker_url:
        return job
    try:
        announce_job(session=session, job_id=job.id, app=app if app is not None else get_app())
    except Exception as exc:  # the broker is down or unreachable; the database already holds the job
        logger.warning("job %s is saved but its shards could not be announced on the broker (%s); the next "
                       "rescue pass (beat, or a worker starting) announces them", job.id, exc)
    return job


def broker_problem(url: str, *, timeout_s: float = 3.0) -> str | None:
    """One line saying why the broker at `url` cannot be reached within `timeout_s`, or None when it can."""
    from kombu import Connection

    from batchinfer.config import mask_url_password

    try:
        with Connection(url, connect_timeout=timeout_s) as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=timeout_s)
    except Exception as exc:  # kombu's OperationalError, a bad URL, a timeout
        return (f"broker {mask_url_password(url)} is unreachable ({exc}); start it, or unset "
                "BATCHINFER_BROKER_URL to work without one (`batchinfer run FILE -o OUT`)")
    return None


def rescue_and_redispatch(*, app: Celery, settings: Settings | None = None,
                          wake_per_model: int = 2) -> shard_store.RescueReport:
    """Rescue expired leases, then announce the requeued shards and wake workers for waiting ones.

    Announcing is idempotent (a taken shard ignores its message), and it covers messages the broker lost
    (a Redis restart without persistence): each model with available shards and no message waiting on its
    queue gets a few wake-up messages (`wake`), and a woken worker claims the rest from the database itself.
    """
    settings = settings or get_settings()
    with session_factory(settings.effective_database_url)() as session:
        report = shard_store.rescue_expired(session)
        requeued = [shard for shard in (session.get(Shard, shard_id) for shard_id in report.requeued)
                    if shard is not None]
        waiting = shard_store.available_shards_per_model(session, limit_per_model=wake_per_model)
    if report.requeued or report.failed:
        logger.info("rescued shards: requeued %s, failed %s", report.requeued, report.failed)
    seen = {s.id for s in requeued}
    wake(app, requeued + [s for s in waiting if s.id not in seen])
    return report


def wake_waiting(*, app: Celery, settings: Settings | None = None, wake_per_model: int = 2) -> int:
    """Wake workers for the first available shards of each model with no message waiting (after a worker
    handed shards back); returns the messages sent."""
    settings = settings or get_settings()
    with session_factory(settings.effective_database_url)() as session:
        waiting = shard_store.available_shards_per_model(session, limit_per_model=wake_per_model)
    return wake(app, waiting)
