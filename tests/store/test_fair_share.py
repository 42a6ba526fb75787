"""Fair share in claim_shard on SQLite and PostgreSQL: owners by weighted recent usage, then within an
owner priority, earliest deadline, oldest; weights per API key; the ledger forgets past its window."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from batchinfer.store import apikeys, shards
from batchinfer.store.fair_share import FAIR_SHARE_WINDOW_S
from batchinfer.store.models import OwnerServed, utcnow
from tests.store.helpers import chat_line, fake_results, jsonl, submit_job


def submit(session, owner: str, count: int, *, shard_size: int = 1, **kwargs):
    lines = [chat_line(f"{owner}-{i}", f"question {i}") for i in range(count)]
    return submit_job(session, model="m", stream=jsonl(*lines), shard_size=shard_size, owner=owner, **kwargs)


def run_one(session, *, owner_of: dict[int, str], worker: str = "w", now=None) -> str:
    """Claim the next shard, write fake results for it and complete it; returns its job's owner."""
    lease = shards.claim_shard(session, worker_id=worker, model="m", lease_seconds=60, now=now)
    assert lease is not None
    pending = shards.pending_requests(session, shard_id=lease.shard_id)
    shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                         results=fake_results(pending), now=now)
    shards.complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token, now=now)
    return owner_of[lease.job_id]


def test_a_second_owner_is_served_next_although_the_first_queued_many_shards_before(session):
    big = submit(session, "alice", 20)
    small = submit(session, "bob", 2)
    owners = {big.id: "alice", small.id: "bob"}
    assert run_one(session, owner_of=owners) == "alice"  # nobody served yet: the oldest shard
    assert run_one(session, owner_of=owners) == "bob"  # alice was served, bob not
    served = [run_one(session, owner_of=owners) for _ in range(4)]
    assert served.count("bob") == 1  # bob's second shard came early, not after alice's 20
    assert served[-2:] == ["alice", "alice"]


def test_running_shards_count_before_any_token_is_written(session):
    big = submit(session, "alice", 5)
    small = submit(session, "bob", 1)
    first = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
    second = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
    assert (first.job_id, second.job_id) == (big.id, small.id)  # the engine's second slot goes to bob


def test_within_an_owner_priority_then_earliest_deadline_then_oldest(session):
    relaxed = submit(session, "carol", 2, completion_window="24h")
    urgent = submit(session, "carol", 2, completion_window="1h")
    also_urgent = submit(session, "carol", 1, completion_window="1h")
    first_class = submit(session, "carol", 1, completion_window="24h", priority=-1)
    order = [shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60).job_id for _ in range(6)]
    assert order == [first_class.id, urgent.id, urgent.id, also_urgent.id, relaxed.id, relaxed.id]


def test_a_heavier_weight_gets_a_larger_share(session):
    apikeys.create_key(session, name="heavy", weight=3)
    apikeys.create_key(session, name="light")
    heavy = submit(session, "heavy", 30)
    light = submit(session, "light", 30)
    owners = {heavy.id: "heavy", light.id: "light"}
    served = [run_one(session, owner_of=owners) for _ in range(20)]
    assert 14 <= served.count("heavy") <= 16  # 3 : 1 of equal-sized shards
    assert apikeys.list_keys(session)[0].weight == 3


def test_usage_outside_the_window_is_forgotten(session):
    early = utcnow() - timedelta(seconds=FAIR_SHARE_WINDOW_S + 120)
    old = submit(session, "alice", 3)
    new = submit(session, "bob", 3)
    owners = {old.id: "alice", new.id: "bob"}
    assert run_one(session, owner_of=owners, now=early) == "alice"  # long ago
    assert run_one(session, owner_of=owners) == "alice"  # bob's served nothing either: oldest first
    assert run_one(session, owner_of=owners) == "bob"
    shards.rescue_expired(session)
    minutes = session.scalar(select(func.count()).select_from(OwnerServed))
    assert minutes == 2  # the minute past the window was pruned


def test_a_delivered_shard_id_wakes_the_worker_for_the_fairest_shard_of_its_model(session):
    big = submit(session, "alice", 3)
    small = submit(session, "bob", 1)
    owners = {big.id: "alice", small.id: "bob"}
    assert run_one(session, owner_of=owners) == "alice"
    alices_next = shards.list_shards(session, job_id=big.id, status="available")[0]
    lease = shards.claim_shard(session, worker_id="w", model="m", shard_id=alices_next.id, lease_seconds=60)
    assert lease.job_id == small.id  # the delivery order does not decide
    exact = shards.claim_shard(session, worker_id="w", shard_id=alices_next.id, lease_seconds=60)
    assert exact.shard_id == alices_next.id  # without a model, exactly that id
