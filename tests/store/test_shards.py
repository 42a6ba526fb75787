"""Shard leases on SQLite and PostgreSQL: fencing, rescue, attempts, concurrent claimers, worker registry."""

from __future__ import annotations

import threading
from datetime import timedelta

import orjson
import pytest
from sqlalchemy import select, text

from batchinfer.store import jobs, shards
from batchinfer.store import workers as worker_store
from batchinfer.store.errors import LeaseLost
from batchinfer.store.export import export_results
from batchinfer.store.models import JobStatus, Request, RequestStatus, Shard, ShardStatus, utcnow
from tests.store.helpers import SETTINGS, chat_line, fake_results, jsonl


def submit(session, count: int, shard_size: int, *, max_attempts: int = SETTINGS.max_attempts, **kwargs):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(count)]
    settings = SETTINGS.model_copy(update={"max_attempts": max_attempts})
    return jobs.submit_job(session, settings=settings, model="m", stream=jsonl(*lines), shard_size=shard_size,
                           **kwargs)


def test_a_stale_lease_token_can_neither_write_nor_complete(session):
    job = submit(session, 4, 4)
    zombie = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=10)
    assert zombie.attempt == 1
    report = shards.rescue_expired(session, now=zombie.lease_expires_at + timedelta(seconds=1))
    assert report.requeued == [zombie.shard_id]
    fresh = shards.claim_shard(session, worker_id="w2", model="m", lease_seconds=10)
    assert fresh.shard_id == zombie.shard_id and fresh.attempt == 2
    assert fresh.lease_token != zombie.lease_token

    pending = shards.pending_requests(session, shard_id=zombie.shard_id)
    with pytest.raises(LeaseLost):
        shards.write_results(session, shard_id=zombie.shard_id, lease_token=zombie.lease_token,
                             results=fake_results(pending))
    with pytest.raises(LeaseLost):
        shards.complete_shard(session, shard_id=zombie.shard_id, lease_token=zombie.lease_token)
    with pytest.raises(LeaseLost):
        shards.fail_shard(session, shard_id=zombie.shard_id, lease_token=zombie.lease_token, error="x")
    assert not shards.heartbeat(session, shard_id=zombie.shard_id, lease_token=zombie.lease_token,
                                lease_seconds=60)
    assert not shards.release_shard(session, shard_id=zombie.shard_id, lease_token=zombie.lease_token)
    assert session.scalar(select(Request.id).where(Request.job_id == job.id,
                                                   Request.status != RequestStatus.PENDING)) is None

    assert shards.heartbeat(session, shard_id=fresh.shard_id, lease_token=fresh.lease_token, lease_seconds=60)
    assert shards.write_results(session, shard_id=fresh.shard_id, lease_token=fresh.lease_token,
                                results=fake_results(pending)) == 4
    assert shards.complete_shard(session, shard_id=fresh.shard_id,
                                 lease_token=fresh.lease_token) == "completed"
    with pytest.raises(LeaseLost):  # a finished shard takes no more writes
        shards.write_results(session, shard_id=fresh.shard_id, lease_token=fresh.lease_token, results=[])


def test_writes_are_idempotent_and_stay_inside_the_shard(session):
    job = submit(session, 6, 3)
    lease = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=60)
    mine = fake_results(shards.pending_requests(session, shard_id=lease.shard_id))
    other_shard = [s for s in shards.list_shards(session, job_id=job.id) if s.id != lease.shard_id][0]
    foreign = fake_results(shards.pending_requests(session, shard_id=other_shard.id))
    assert shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                results=mine[:2] + foreign) == 2  # another shard's requests are not ours
    assert shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                results=mine) == 1  # the first two were already written
    job = jobs.get_job(session, job_id=job.id)
    assert job.request_counts == {"total": 6, "completed": 3, "failed": 0}
    with pytest.raises(ValueError, match="choices"):
        shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                             results=[{"request_id": 1, "choices": []}])


def test_error_results_and_missing_results_are_counted_as_failed(session):
    job = submit(session, 3, 3)
    lease = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=60)
    first, second, _third = shards.pending_requests(session, shard_id=lease.shard_id)
    shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=[
        *fake_results([first]),
        {"request_id": second.request_id,
         "error": {"code": "context_length_exceeded",
                   "message": "prompt is 9000 tokens; max_model_len is 8192"}}])
    assert shards.complete_shard(session, shard_id=lease.shard_id,
                                 lease_token=lease.lease_token) == "completed"
    job = jobs.get_job(session, job_id=job.id)
    assert job.status == JobStatus.COMPLETED
    assert job.request_counts == {"total": 3, "completed": 1, "failed": 2}
    codes = [orjson.loads(x)["error"]["code"]
             for x in export_results(session, job_id=job.id, kind="errors")]
    assert sorted(codes) == ["context_length_exceeded", "missing_result"]


def test_rescue_fails_the_shard_after_max_attempts_with_worker_lost(session):
    job = submit(session, 5, 5, max_attempts=2)
    now = utcnow()
    for attempt in (1, 2):
        lease = shards.claim_shard(session, worker_id=f"w{attempt}", model="m", lease_seconds=5, now=now)
        assert lease.attempt == attempt
        if attempt == 1:
            pending = shards.pending_requests(session, shard_id=lease.shard_id)
            shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                 results=fake_results(pending)[:2])
        now += timedelta(seconds=10)
        report = shards.rescue_expired(session, now=now)
    assert report.failed == [lease.shard_id] and report.requeued == []
    job = jobs.get_job(session, job_id=job.id)
    assert job.status == JobStatus.COMPLETED  # the job still finishes, with the lost requests errored
    assert job.request_counts == {"total": 5, "completed": 2, "failed": 3}
    errors = [orjson.loads(x)["error"] for x in export_results(session, job_id=job.id, kind="errors")]
    assert {e["code"] for e in errors} == {"worker_lost"}
    assert "w2 stopped heartbeating" in errors[0]["message"]
    assert session.get(Shard, lease.shard_id).status == ShardStatus.FAILED


def test_release_gives_the_attempt_back_and_fail_shard_spends_it(session):
    submit(session, 2, 2, max_attempts=2)
    lease = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=60)
    assert shards.release_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)
    lease = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=60)
    assert lease.attempt == 1
    assert shards.fail_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                             error="engine crashed") == "available"
    lease = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=60)
    assert lease.attempt == 2
    assert shards.fail_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                             error="engine crashed") == "failed"
    errors = session.scalars(select(Request.error_message)
                             .where(Request.status == RequestStatus.ERRORED)).all()
    assert sorted(errors) == [f"line {n}: engine crashed (after 2 attempt(s))" for n in (1, 2)]


def test_claim_by_shard_id_and_by_priority(session):
    low = submit(session, 2, 1, priority=5)
    high = submit(session, 2, 1, priority=-1)
    target = shards.list_shards(session, job_id=low.id)[1]
    lease = shards.claim_shard(session, worker_id="w1", shard_id=target.id, lease_seconds=60)
    assert lease.shard_id == target.id
    duplicate_delivery = shards.claim_shard(session, worker_id="w2", shard_id=target.id, lease_seconds=60)
    assert duplicate_delivery is None
    nxt = shards.claim_shard(session, worker_id="w2", model="m", lease_seconds=60)
    assert nxt.job_id == high.id  # lower priority value first
    assert shards.claim_shard(session, worker_id="w2", model="other-model", lease_seconds=60) is None


def claim_everything(make_session, threads: int) -> list[int]:
    claimed: list[int] = []
    lock, errors = threading.Lock(), []
    barrier = threading.Barrier(threads)

    def claimer(n: int) -> None:
        try:
            with make_session() as session:
                barrier.wait()
                while (lease := shards.claim_shard(session, worker_id=f"t{n}", model="m", lease_seconds=60)):
                    with lock:
                        claimed.append(lease.shard_id)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    workers = [threading.Thread(target=claimer, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    return claimed


def test_concurrent_claimers_never_get_the_same_shard(session, make_session):
    job = submit(session, 60, 1)
    claimed = claim_everything(make_session, threads=6)
    all_ids = [s.id for s in shards.list_shards(session, job_id=job.id)]
    assert len(claimed) == len(set(claimed)) == 60 and sorted(claimed) == sorted(all_ids)
    owners = session.execute(select(Shard.lease_owner, Shard.lease_token).where(Shard.job_id == job.id)).all()
    assert len({token for _, token in owners}) == 60


def test_skip_locked_passes_over_a_shard_being_claimed(pg_url):
    """PostgreSQL: a shard row locked by another transaction is skipped, not waited for."""
    from batchinfer.store.db import get_engine, session_factory, upgrade

    upgrade(pg_url)
    make_session = session_factory(pg_url)
    with make_session() as session:
        job = submit(session, 3, 1)
        first = shards.list_shards(session, job_id=job.id)[0].id
    with get_engine(pg_url).connect() as blocker:
        blocker.execute(text("SELECT id FROM shards WHERE id = :id FOR UPDATE"), {"id": first})
        with make_session() as session:
            session.execute(text("SET lock_timeout = '2s'"))
            session.commit()
            lease = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
        blocker.rollback()
    assert lease is not None and lease.shard_id != first
    get_engine(pg_url).dispose()


def test_worker_registry_lists_live_workers_and_their_shards(session):
    submit(session, 2, 1)
    now = utcnow()
    worker_store.register_worker(session, worker_id="gpu-0", model="m", hostname="host-a", pid=11, now=now)
    worker_store.register_worker(session, worker_id="gpu-1", model="m", hostname="host-b",
                                 now=now - timedelta(minutes=5))
    lease = shards.claim_shard(session, worker_id="gpu-0", model="m", lease_seconds=60)
    assert worker_store.worker_heartbeat(session, worker_id="gpu-0", now=now)
    assert not worker_store.worker_heartbeat(session, worker_id="ghost")
    live = worker_store.list_workers(session, live_within_seconds=60, now=now)
    assert [(w.worker_id, w.shard_ids, w.live) for w in live] == [("gpu-0", [lease.shard_id], True)]
    everyone = worker_store.list_workers(session, include_dead=True, now=now)
    assert [(w.worker_id, w.live) for w in everyone] == [("gpu-0", True), ("gpu-1", False)]
    worker_store.deregister_worker(session, worker_id="gpu-0")
    assert worker_store.list_workers(session, now=now) == []
