"""A running job whose predicted finish falls after its deadline is marked at risk (issue 32): in the batch
object's progress (`at_risk`, and a note `batchinfer status` prints) as soon as its ETA is known."""

from __future__ import annotations

from datetime import timedelta

from batchinfer.store import shards
from batchinfer.store.jobs import get_job
from batchinfer.store.serialize import batch_object
from tests.store.helpers import chat_line, fake_results, jsonl, submit_job


def one_line_done_after_100_s(session, window: str):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(100)]
    job = submit_job(session, model="m", stream=jsonl(*lines), shard_size=100, completion_window=window)
    lease = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
    pending = shards.pending_requests(session, shard_id=lease.shard_id)
    shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                         results=fake_results(pending[:1]))
    job = get_job(session, job_id=job.id)
    return batch_object(job, now=job.created_at + timedelta(seconds=100),
                        started_at=job.created_at).model_dump(mode="json")


def test_a_job_that_would_finish_after_its_deadline_is_at_risk(session):
    batch = one_line_done_after_100_s(session, "1h")  # 99 lines left at one line per 100 s: ~2.75 h
    progress = batch["progress"]
    assert progress["eta_seconds"] > 3600
    assert progress["at_risk"] is True
    assert progress["note"].startswith("at risk: expected to finish in ")


def test_a_job_that_finishes_within_its_window_is_not(session):
    progress = one_line_done_after_100_s(session, "24h")["progress"]
    assert progress["at_risk"] is False and progress["note"] is None


def test_the_metric_counts_the_running_jobs_at_risk(session, db_url):
    from sqlalchemy import update

    from batchinfer.api.metrics import JobsCollector
    from batchinfer.config import Settings
    from batchinfer.store.db import session_factory
    from batchinfer.store.models import Shard, utcnow
    from batchinfer.store.serialize import jobs_at_risk

    one_line_done_after_100_s(session, "1h")
    one_line_done_after_100_s(session, "24h")
    with session.begin():  # their first claims were 100 s ago: one line per 100 s
        session.execute(update(Shard).values(started_at=utcnow() - timedelta(seconds=100)))
    assert jobs_at_risk(session) == 1
    collector = JobsCollector(session_factory(db_url), Settings(database_url=db_url))
    gauges = {family.name: family for family in collector.collect()}
    assert gauges["batchinfer:jobs_at_risk"].samples[0].value == 1
