"""The worker registry: who runs which model, whether it heartbeated lately, and the shards it holds.

A worker registers at start, heartbeats while alive and deregisters on a clean shutdown; the shards it
holds are those whose lease names it (see shards.py), so the registry itself never holds work.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batchinfer.store.db import end_transaction, rowcount, write_transaction
from batchinfer.store.models import Shard, ShardStatus, Worker, utcnow
from batchinfer.wire.heartbeat import HeartbeatInfo

WORKER_LIVE_S = 60.0  # a worker that heartbeated within this long (and did not stop) counts as live


@dataclass(frozen=True)
class WorkerInfo:
    """A registered worker, whether it heartbeated recently, and the shards it holds."""

    worker_id: str
    hostname: str
    model: str
    pid: int | None
    started_at: datetime
    last_heartbeat_at: datetime
    live: bool
    shard_ids: list[int]
    info: HeartbeatInfo | None = None  # what the worker reports (workers.metrics.heartbeat_info)


def register_worker(session: Session, *, worker_id: str, model: str, hostname: str = "",
                    pid: int | None = None, info: HeartbeatInfo | None = None,
                    now: datetime | None = None) -> None:
    """Record a worker starting (or restarting under the same id)."""
    now = now or utcnow()
    with write_transaction(session):
        worker = session.get(Worker, worker_id, populate_existing=True)
        if worker is None:
            session.add(Worker(id=worker_id, model=model, hostname=hostname, pid=pid, info=info,
                               started_at=now, last_heartbeat_at=now))
        else:
            worker.model, worker.hostname, worker.pid = model, hostname, pid
            worker.info = dict(info) if info is not None else None
            worker.started_at, worker.last_heartbeat_at, worker.stopped_at = now, now, None


def worker_heartbeat(session: Session, *, worker_id: str, now: datetime | None = None,
                     info: HeartbeatInfo | None = None) -> bool:
    """Mark the worker alive (and replace its `info` when given); False if it was never registered."""
    values: dict[str, object] = {"last_heartbeat_at": now or utcnow()}
    if info is not None:
        values["info"] = info
    with write_transaction(session):
        result = session.execute(update(Worker).where(Worker.id == worker_id).values(**values)
                                 .execution_options(synchronize_session=False))
    return rowcount(result) == 1


def deregister_worker(session: Session, *, worker_id: str, now: datetime | None = None) -> None:
    """Record a clean worker shutdown."""
    with write_transaction(session):
        session.execute(update(Worker).where(Worker.id == worker_id).values(stopped_at=now or utcnow())
                        .execution_options(synchronize_session=False))


def served_models(session: Session, *, now: datetime | None = None) -> list[str]:
    """The models live workers serve (heartbeat within WORKER_LIVE_S, not stopped), sorted, each once; the
    LoRA adapters a worker serves (its info's lora_adapters) count as models."""
    cutoff = (now or utcnow()) - timedelta(seconds=WORKER_LIVE_S)
    rows = session.execute(select(Worker.model, Worker.info).where(
        Worker.stopped_at.is_(None), Worker.last_heartbeat_at >= cutoff)).all()
    end_transaction(session)
    models = {model for model, _ in rows}
    models.update(name for _, info in rows for name in (info or {}).get("lora_adapters", ()))
    return sorted(models)


def list_workers(session: Session, *, live_within_seconds: float = WORKER_LIVE_S, include_dead: bool = False,
                 now: datetime | None = None) -> list[WorkerInfo]:
    """Workers with their running shards; live = heartbeat within `live_within_seconds` and not stopped."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=live_within_seconds)
    held: dict[str | None, list[int]] = {}  # by lease owner (a worker id)
    for shard_id, owner in session.execute(select(Shard.id, Shard.lease_owner)
                                           .where(Shard.status == ShardStatus.RUNNING).order_by(Shard.id)):
        held.setdefault(owner, []).append(shard_id)
    out = []
    for worker in session.scalars(select(Worker).order_by(Worker.id)):
        live = worker.stopped_at is None and worker.last_heartbeat_at >= cutoff
        if live or include_dead:
            out.append(WorkerInfo(worker.id, worker.hostname, worker.model, worker.pid, worker.started_at,
                                  worker.last_heartbeat_at, live, held.get(worker.id, []),
                                  cast("HeartbeatInfo | None", worker.info)))  # as register_worker wrote it
    end_transaction(session)
    return out
