"""Recovery in the store: the ingest lease (a dead submit's job is failed, its key released), the
single-flight locks of the periodic duties, and expiry. The whole topology is tests/acceptance/."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from batchinfer.store.db import exclusive, session_factory, single_flight, write_transaction
from batchinfer.store.ingest_lease import (
    INGEST_LOST,
    IngestLease,
    extend_ingest_lease,
    new_ingest_owner,
    owner_gone,
)
from batchinfer.store.jobs import expire_jobs, get_job
from batchinfer.store.models import Job, JobStatus, Request, utcnow
from batchinfer.store.shards import rescue_expired
from tests.store.helpers import chat_line, jsonl, submit_job


def _wedged_job(session, *, owner: str, lease_left_s: float, key: str = "nightly") -> Job:
    """A job as a submit leaves it mid-ingest: validating, a lease, some request rows already written."""
    job = submit_job(session, stream=jsonl(chat_line("a", "hi"), chat_line("b", "ho")), model="m",
                     idempotency_key=key)
    with write_transaction(session):
        session.execute(update(Job).where(Job.id == job.id).values(
            status=JobStatus.VALIDATING, ingest_owner=owner, num_shards=0,
            ingest_lease_expires_at=utcnow() + timedelta(seconds=lease_left_s)))
    return job


def _request_rows(session, job_id: int) -> int:
    count = session.scalar(select(func.count()).select_from(Request).where(Request.job_id == job_id))
    session.commit()
    return count


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_rescuer_fails_a_job_whose_ingest_lease_expired_and_releases_its_key(session):
    job = _wedged_job(session, owner="elsewhere:4242:abcd", lease_left_s=-1)
    report = rescue_expired(session)
    assert report.lost_ingests == [job.id]
    failed = get_job(session, job_id=job.id)
    assert failed.status == JobStatus.FAILED and failed.idempotency_key is None
    assert failed.errors[0]["code"] == INGEST_LOST
    assert "elsewhere:4242:abcd" in failed.errors[0]["message"]
    assert "Submit the file again" in failed.errors[0]["message"]
    assert _request_rows(session, job.id) == 0
    assert rescue_expired(session).lost_ingests == []  # idempotent

    retry = submit_job(session, stream=jsonl(chat_line("a", "hi")), model="m", idempotency_key="nightly")
    assert retry.id != job.id and retry.status == JobStatus.IN_PROGRESS


def test_a_live_ingest_keeps_its_job_and_its_key(session):
    job = _wedged_job(session, owner="elsewhere:4242:abcd", lease_left_s=60)
    assert rescue_expired(session).lost_ingests == []
    again = submit_job(session, stream=jsonl(chat_line("a", "hi")), model="m", idempotency_key="nightly")
    assert again.id == job.id and again.status == JobStatus.VALIDATING  # it is still being ingested


def test_a_retry_on_the_same_host_does_not_wait_for_a_dead_submits_lease(session):
    owner = new_ingest_owner().replace(f":{os.getpid()}:", f":{_dead_pid()}:")
    assert owner.startswith(socket.gethostname())
    assert owner_gone(owner) and not owner_gone(f"elsewhere:{_dead_pid()}:abcd")
    assert not owner_gone(new_ingest_owner())  # this very process
    job = _wedged_job(session, owner=owner, lease_left_s=60)
    retry = submit_job(session, stream=jsonl(chat_line("a", "hi")), model="m", idempotency_key="nightly")
    assert retry.id != job.id
    old = get_job(session, job_id=job.id)
    assert old.status == JobStatus.FAILED and "exited" in old.errors[0]["message"]


class _RescuedMidway(io.BytesIO):
    """A file whose reading stalls long enough, at line 2, for the rescuer to take the ingest lease."""

    def __init__(self, data: bytes, url: str) -> None:
        super().__init__(data)
        self.url, self.lines = url, 0

    def readline(self, *args) -> bytes:  # noqa: ANN002
        self.lines += 1
        if self.lines == 2:
            with session_factory(self.url)() as other:
                with write_transaction(other):
                    other.execute(update(Job).where(Job.status == JobStatus.VALIDATING)
                                  .values(ingest_lease_expires_at=utcnow() - timedelta(seconds=1)))
                assert rescue_expired(other).lost_ingests
        return super().readline(*args)


def test_a_submit_that_lost_its_lease_stops_and_drops_what_it_wrote(session, db_url):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(5)]
    job = submit_job(session, stream=_RescuedMidway(jsonl(*lines).getvalue(), db_url), model="m",
                     idempotency_key="slow")
    assert job.status == JobStatus.FAILED and job.errors[0]["code"] == INGEST_LOST
    assert _request_rows(session, job.id) == 0


def test_the_ingest_lease_is_extended_while_held_and_lost_once_taken(session, db_url):
    job = _wedged_job(session, owner="here:1:aaaa", lease_left_s=0.5)
    engine = session.get_bind()
    with IngestLease(engine, job_id=job.id, owner="here:1:aaaa", lease_seconds=0.4) as lease:
        threading.Event().wait(0.6)  # two extensions
        assert get_job(session, job_id=job.id).ingest_lease_expires_at > utcnow()
        lease.check()  # still ours
        with write_transaction(session):
            session.execute(update(Job).where(Job.id == job.id).values(ingest_owner="rescuer-took-it"))
        threading.Event().wait(0.3)
        assert lease.lost.is_set()
    assert not extend_ingest_lease(engine, job_id=job.id, owner="here:1:aaaa", lease_seconds=1)


def test_exclusive_admits_one_holder_at_a_time(db_url):
    with exclusive(db_url, 77) as first, exclusive(db_url, 77) as second, exclusive(db_url, 78) as other:
        assert (first, second, other) == (True, False, True)
    with exclusive(db_url, 77) as again:
        assert again


def test_expiry_is_single_flight_and_idempotent(session, make_session, db_url):
    job = submit_job(session, stream=jsonl(chat_line("a", "hi")), model="m", completion_window="1s")
    later = utcnow() + timedelta(seconds=5)
    if not db_url.startswith("sqlite"):  # another expirer holds the lock: this pass skips
        with make_session() as other, write_transaction(other):
            from batchinfer.store.jobs import EXPIRY_LOCK_KEY

            assert single_flight(other, EXPIRY_LOCK_KEY)
            assert expire_jobs(session, now=later) == []
    assert expire_jobs(session, now=later) == [job.id]
    assert expire_jobs(session, now=later) == []
    assert get_job(session, job_id=job.id).status == JobStatus.EXPIRED


@pytest.mark.parametrize("owner", [None, "", "no-colons", "host:notapid:x"])
def test_owner_gone_is_false_when_it_cannot_tell(owner):
    assert not owner_gone(owner)


def test_a_lost_ingest_gives_its_request_bytes_back_to_the_owner(session):
    from batchinfer.store.quotas import charge_storage, stored_bytes

    job = _wedged_job(session, owner="elsewhere:4242:abcd", lease_left_s=-1)
    with write_transaction(session):  # what reserve_job charged when the API created it
        session.execute(update(Job).where(Job.id == job.id).values(request_bytes=100))
        charge_storage(session, owner=job.owner, delta=100)
    assert stored_bytes(session, owner=job.owner) == 100
    assert rescue_expired(session).lost_ingests == [job.id]
    assert stored_bytes(session, owner=job.owner) == 0 and get_job(session, job_id=job.id).request_bytes == 0
