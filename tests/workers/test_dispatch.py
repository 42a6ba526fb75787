"""Announcing on the broker: submit_and_announce on a real Redis, a broker that is down, no broker at all.

Also the seam between the sending side and the worker side: the app and the dispatcher load no engine
(the API and CLI import them), and the worker's app has every task beat schedules.
"""

from __future__ import annotations

import base64
import logging
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from batchinfer.config import Settings
from batchinfer.store import shards as shard_store
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.models import ShardStatus
from tests.workers.helpers import write_requests
from workers.app import EXPIRE, RESCUE, RUN_SHARD, SCHEDULE_TICK, create_celery_app, queue_name
from workers.dispatch import submit_and_announce

MODEL = "announce-test-model"


def _settings(url: str, tmp_path: Path, broker_url: str | None) -> Settings:
    upgrade(url)
    return Settings(database_url=url, broker_url=broker_url, data_dir=tmp_path)


def _queued_shard_ids(redis_url: str) -> list[int]:
    """The shard ids of the run_shard messages waiting on MODEL's queue (kombu's Redis list)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        messages = [orjson.loads(raw) for raw in client.lrange(queue_name(MODEL), 0, -1)]
    finally:
        client.close()
    assert all(m["headers"]["task"] == RUN_SHARD for m in messages)
    return sorted(orjson.loads(base64.b64decode(m["body"]))[0][0] for m in messages)


@pytest.mark.redis
def test_one_message_per_available_shard(sqlite_url: str, redis_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path, redis_url)
    path = tmp_path / "in.jsonl"
    write_requests(path, 10)
    app = create_celery_app(settings)
    with session_factory(sqlite_url)() as session:
        job = submit_and_announce(session=session, settings=settings, app=app, path=path, model=MODEL,
                                  owner="t", shard_size=4)
        shard_ids = [s.id for s in shard_store.list_shards(session, job_id=job.id)]
    assert job.status == "in_progress"
    assert len(shard_ids) == 3
    assert _queued_shard_ids(redis_url) == shard_ids


@pytest.mark.redis
def test_a_failed_job_is_not_announced(sqlite_url: str, redis_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path, redis_url)
    path = tmp_path / "in.jsonl"
    write_requests(path, 3, extra_lines=[b"not json"])
    with session_factory(sqlite_url)() as session:
        job = submit_and_announce(session=session, settings=settings, app=create_celery_app(settings),
                                  path=path, model=MODEL, owner="t", on_invalid="fail")
    assert job.status == "failed"
    assert _queued_shard_ids(redis_url) == []


def test_a_broker_that_is_down_leaves_the_job_saved_and_says_so(
        sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = _settings(sqlite_url, tmp_path, "redis://127.0.0.1:1/0")  # nothing listens on port 1
    path = tmp_path / "in.jsonl"
    write_requests(path, 4)
    app = create_celery_app(settings)
    app.conf.broker_connection_timeout = 1
    sessions = session_factory(sqlite_url)
    with caplog.at_level(logging.WARNING, logger="batchinfer.workers"), sessions() as session:
        job = submit_and_announce(session=session, settings=settings, app=app, path=path, model=MODEL,
                                  owner="t", shard_size=2)
        available = shard_store.list_shards(session, job_id=job.id, status=ShardStatus.AVAILABLE)
    assert job.status == "in_progress"
    assert len(available) == 2  # waiting for the next rescue pass to announce them
    assert f"job {job.id} is saved but its shards could not be announced" in caplog.text


class _NoBroker:
    """Stands in for a Celery app where none may be used: any message is a test failure."""

    def send_task(self, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"announced without a broker: {args} {kwargs}")


def test_without_a_broker_nothing_is_announced(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path, None)
    path = tmp_path / "in.jsonl"
    write_requests(path, 4)
    with session_factory(sqlite_url)() as session:
        job = submit_and_announce(session=session, settings=settings,
                                  app=_NoBroker(),  # type: ignore[arg-type]
                                  path=path, model=MODEL, owner="t", shard_size=2)
    assert job.status == "in_progress"


def test_the_sending_side_loads_no_engine() -> None:
    code = ("import sys, workers.app, workers.dispatch; "
            "assert 'torch' not in sys.modules, 'the dispatcher imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_the_worker_app_has_every_task_beat_sends() -> None:
    import workers.celery_app

    app = workers.celery_app.app
    assert workers.celery_app.app is app  # one app per process, tasks registered once
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert {RESCUE, EXPIRE, SCHEDULE_TICK} <= scheduled
    assert {RUN_SHARD, *scheduled} <= set(app.tasks)


@pytest.mark.redis
def test_rescue_wakes_a_model_nobody_serves_once_not_every_pass(sqlite_url: str, redis_url: str,
                                                                 tmp_path: Path) -> None:
    # Issue 28 item 11: beat and every worker run rescue every 30 s; no worker serves MODEL, so nothing
    # takes its messages. A pass sends wake-ups only while none waits, so the queue stays bounded.
    import redis

    from workers.dispatch import rescue_and_redispatch

    settings = _settings(sqlite_url, tmp_path, redis_url)
    path = tmp_path / "in.jsonl"
    write_requests(path, 12)
    app = create_celery_app(settings)
    with session_factory(sqlite_url)() as session:
        submit_and_announce(session=session, settings=settings, app=app, path=path, model=MODEL, owner="t",
                            shard_size=4)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.llen(queue_name(MODEL)) == 3  # the submit's own announcements, one per shard
        for _ in range(5):
            rescue_and_redispatch(app=app, settings=settings)
        assert client.llen(queue_name(MODEL)) == 3  # messages wait: no pass added any
        client.delete(queue_name(MODEL))  # taken by a worker that died, or lost in a Redis restart
        for _ in range(5):
            rescue_and_redispatch(app=app, settings=settings)
        assert client.llen(queue_name(MODEL)) == 2  # one pass woke the model (wake_per_model), the rest none
    finally:
        client.close()
