"""Job round trip on SQLite and PostgreSQL: submit, claim, write results, complete, export; cancel; expire."""

from __future__ import annotations

import io
from datetime import timedelta

import orjson
import pytest
from sqlalchemy import select

from batchinfer.store import jobs, shards
from batchinfer.store.errors import JobError, JobNotFound, JobStateError
from batchinfer.store.export import export_results
from batchinfer.store.models import JobStatus, Request, RequestStatus, Shard, ShardStatus, utcnow
from batchinfer.store.serialize import batch_object
from batchinfer.wire.output_line import ChatCompletion, TextCompletion, read_output_line
from tests.store.helpers import chat_line, fake_results, jsonl, submit_job

SYSTEMS = ["You are a pirate. Answer every question in pirate speak, with at least one 'arr'. " * 2,
           "You are a careful math tutor: show the key step, then the result on its own line. " * 2,
           "You answer in French only, in one short sentence, never in English or any other language. " * 2]


def mixed_lines(count: int) -> list[bytes]:
    """Chat lines with three shared system prompts (interleaved), completions and shorthand lines."""
    out = []
    for i in range(count):
        if i % 5 == 4:
            out.append(orjson.dumps({"custom_id": f"t{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"model": "m", "prompt": f"Story {i}:", "max_tokens": 8}}))
        elif i % 7 == 6:
            out.append(orjson.dumps({"prompt": f"Short {i}", "temperature": 0}))
        else:
            out.append(chat_line(f"c{i}", f"question number {i}", system=SYSTEMS[i % 3], max_tokens=16))
    return out


def run_all(session, *, model: str = "m", worker: str = "w1") -> int:
    """Claim every shard in turn and answer all its requests; returns the number of shards run."""
    ran = 0
    while (lease := shards.claim_shard(session, worker_id=worker, model=model, lease_seconds=60)) is not None:
        pending = shards.pending_requests(session, shard_id=lease.shard_id)
        assert len(pending) == lease.num_requests
        results = fake_results(pending)
        for start in range(0, len(results), 4):  # small write batches, as a worker flushes them
            shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                 results=results[start:start + 4])
        shards.complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)
        ran += 1
    return ran


def test_round_trip_exports_every_custom_id_once_in_input_order(session):
    lines = mixed_lines(60)
    job = submit_job(session, model="m", stream=jsonl(*lines), shard_size=8, metadata={"team": "qa"})
    assert job.status == JobStatus.IN_PROGRESS and job.num_shards == 8 and job.meta == {"team": "qa"}
    assert run_all(session) == 8
    job = jobs.get_job(session, job_id=job.id)
    assert job.status == JobStatus.COMPLETED
    assert job.completed_at is not None and job.finalizing_at is not None

    out = [orjson.loads(x) for x in export_results(session, job_id=job.id, chunk_size=7)]
    expected_ids = [orjson.loads(x).get("custom_id", f"line-{n}") for n, x in enumerate(lines, 1)]
    assert [o["custom_id"] for o in out] == expected_ids  # each exactly once, input order
    for o in out:
        parsed = read_output_line(o)
        assert parsed.response.status_code == 200 and parsed.error is None
        choice = parsed.response.body.choices[0]
        assert choice.get("message", {}).get("content", choice.get("text")) == f"answer to {o['custom_id']}"
        expected_object = TextCompletion if o["custom_id"][0] in "tl" else ChatCompletion  # by its "object"
        assert isinstance(parsed.response.body, expected_object)
    assert list(export_results(session, job_id=job.id, kind="errors")) == []
    with pytest.raises(JobStateError, match="is completed"):
        jobs.cancel_job(session, job_id=job.id)

    prompt = sum(10 + n % 7 for n in range(1, 61))
    assert job.request_counts == {"total": 60, "completed": 60, "failed": 0}
    cached = sum((10 + n % 7) // 2 for n in range(1, 61))
    assert job.usage == {"prompt_tokens": prompt, "completion_tokens": 180, "total_tokens": prompt + 180,
                         "prompt_tokens_details": {"cached_tokens": cached}}
    summary = batch_object(job).model_dump(mode="json")
    assert summary["id"] == f"batch_{job.id}" and summary["status"] == "completed"
    assert summary["request_counts"]["completed"] == 60


def test_shards_keep_shared_prefixes_together(session):
    job = submit_job(session, model="m", stream=jsonl(*mixed_lines(90)), shard_size=10)
    order = []  # every request, shard after shard, in the order a worker gets them
    for shard in shards.list_shards(session, job_id=job.id):
        pending = shards.pending_requests(session, shard_id=shard.id)
        assert len(pending) == shard.num_requests
        order.extend(pending)
    assert len(order) == 90 and len({p.request_id for p in order}) == 90  # each request in exactly one shard
    systems = [p.messages[0]["content"] if p.messages else None for p in order]
    for system in SYSTEMS:  # interleaved in the file (i % 3), contiguous in shard order
        positions = [i for i, s in enumerate(systems) if s == system]
        assert positions == list(range(positions[0], positions[0] + len(positions)))


def test_cancel_keeps_finished_results_and_cancels_the_rest(session):
    job = submit_job(session, model="m", stream=jsonl(*mixed_lines(30)), shard_size=10)
    first = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=60)
    done = fake_results(shards.pending_requests(session, shard_id=first.shard_id))
    shards.write_results(session, shard_id=first.shard_id, lease_token=first.lease_token, results=done)
    shards.complete_shard(session, shard_id=first.shard_id, lease_token=first.lease_token)
    running = shards.claim_shard(session, worker_id="w2", model="m", lease_seconds=60)
    half = fake_results(shards.pending_requests(session, shard_id=running.shard_id))[:5]
    shards.write_results(session, shard_id=running.shard_id, lease_token=running.lease_token, results=half)

    job = jobs.cancel_job(session, job_id=job.id)
    assert job.status == JobStatus.CANCELLING  # a shard is still running
    assert not shards.heartbeat(session, shard_id=running.shard_id, lease_token=running.lease_token,
                                lease_seconds=60)
    # the idle shards were cancelled
    assert shards.claim_shard(session, worker_id="w3", model="m", lease_seconds=60) is None
    assert shards.release_shard(session, shard_id=running.shard_id, lease_token=running.lease_token)
    job = jobs.get_job(session, job_id=job.id)
    assert job.status == JobStatus.CANCELLED and job.cancelled_at is not None
    assert shards.shard_counts(session, job_id=job.id) == {"completed": 1, "cancelled": 2}

    out = [orjson.loads(x)["custom_id"] for x in export_results(session, job_id=job.id)]
    assert len(out) == 15 and len(set(out)) == 15  # 10 + 5 finished results kept
    errors = [orjson.loads(x) for x in export_results(session, job_id=job.id, kind="errors")]
    assert len(errors) == 15 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert job.request_counts == {"total": 30, "completed": 15, "failed": 0}
    assert jobs.cancel_job(session, job_id=job.id).status == JobStatus.CANCELLED  # idempotent
    with pytest.raises(JobNotFound, match="not found"):
        jobs.cancel_job(session, job_id=job.id, owner="someone-else")


def test_cancel_with_nothing_running_is_immediate(session):
    job = submit_job(session, model="m", stream=jsonl(*mixed_lines(5)))
    job = jobs.cancel_job(session, job_id=job.id)
    assert job.status == JobStatus.CANCELLED
    statuses = session.scalars(select(Request.status).where(Request.job_id == job.id)).all()
    assert set(statuses) == {RequestStatus.CANCELED}


def test_expire_jobs_past_their_window(session):
    job = submit_job(session, model="m", stream=jsonl(*mixed_lines(12)), shard_size=4, completion_window="1h")
    lease = shards.claim_shard(session, worker_id="w1", model="m", lease_seconds=60)
    shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                         results=fake_results(shards.pending_requests(session, shard_id=lease.shard_id)))
    assert jobs.expire_jobs(session, now=utcnow() + timedelta(minutes=30)) == []
    assert jobs.expire_jobs(session, now=utcnow() + timedelta(hours=2)) == [job.id]
    job = jobs.get_job(session, job_id=job.id)
    assert job.status == JobStatus.EXPIRED and job.expired_at is not None
    assert not shards.heartbeat(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                lease_seconds=60)
    assert shards.complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token) == "expired"
    assert len(list(export_results(session, job_id=job.id))) == 4
    codes = {orjson.loads(x)["error"]["code"]
             for x in export_results(session, job_id=job.id, kind="errors")}
    assert codes == {"batch_expired"}
    assert session.get(Shard, lease.shard_id).status == ShardStatus.CANCELLED


def test_idempotency_key_returns_the_same_job(session):
    first = submit_job(session, model="m", stream=jsonl(*mixed_lines(3)), idempotency_key="nightly-1",
                            owner="alice")
    again = submit_job(session, model="m", stream=jsonl(*mixed_lines(9)), idempotency_key="nightly-1",
                            owner="alice")
    other_owner = submit_job(session, model="m", stream=jsonl(*mixed_lines(2)), idempotency_key="nightly-1",
                                  owner="bob")
    assert again.id == first.id and again.total_requests == 3
    assert other_owner.id != first.id


def test_list_jobs_pages_newest_first_per_owner(session):
    made = [submit_job(session, model="m", stream=jsonl(*mixed_lines(1)), owner=o).id
            for o in ["a", "b", "a", "a", "b", "a"]]
    mine = [j for j, o in zip(made, "abaaba", strict=True) if o == "a"][::-1]
    page1 = jobs.list_jobs(session, owner="a", limit=3)
    page2 = jobs.list_jobs(session, owner="a", limit=3, after=page1[-1].id)
    assert [j.id for j in page1 + page2] == mine
    assert jobs.get_job(session, job_id=made[1], owner="a") is None
    assert jobs.get_job(session, job_id=made[1], owner="b").id == made[1]


def test_endpoint_of_the_batch_is_enforced(session):
    job = submit_job(session, model="m", stream=jsonl(*mixed_lines(10)), endpoint="/v1/chat/completions")
    assert job.status == JobStatus.IN_PROGRESS
    errored = session.scalars(select(Request.line_number).where(
        Request.job_id == job.id, Request.status == RequestStatus.ERRORED)
        .order_by(Request.line_number)).all()
    assert errored == [5, 7, 10]  # the completion and shorthand-prompt lines
    assert job.request_counts["failed"] == 3 and "batch endpoint" in job.errors[0]["message"]


def test_submit_from_path_and_bad_arguments(session, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(mixed_lines(4)))  # no final newline
    job = submit_job(session, model="m", path=path)
    assert job.total_requests == 4 and job.input_path == str(path)
    with pytest.raises(JobError, match="exactly one"):
        submit_job(session, model="m")
    with pytest.raises(JobError, match="on_invalid"):
        submit_job(session, model="m", stream=io.BytesIO(b""), on_invalid="ignore")
    with pytest.raises(JobError, match="completion_window"):
        submit_job(session, model="m", stream=io.BytesIO(b""), completion_window="soon")
    with pytest.raises(JobError, match="metadata"):
        submit_job(session, model="m", stream=io.BytesIO(b""), metadata={"k": 1})
    with pytest.raises(FileNotFoundError):
        submit_job(session, model="m", path=tmp_path / "missing.jsonl")


class CancelWhileReading(io.BytesIO):
    """An upload that gets cancelled (from another session) while it is being ingested."""

    def __init__(self, data: bytes, make_session) -> None:
        super().__init__(data)
        self.make_session, self.reads = make_session, 0

    def readline(self, size: int | None = -1) -> bytes:
        self.reads += 1
        if self.reads == 5:
            with self.make_session() as other:
                job = jobs.list_jobs(other, limit=1)[0]
                assert job.status == JobStatus.VALIDATING
                assert jobs.cancel_job(other, job_id=job.id).status == JobStatus.CANCELLED
        return super().readline(size)


def test_a_job_cancelled_while_validating_stays_cancelled(session, make_session):
    data = b"".join(line + b"\n" for line in mixed_lines(20))
    job = submit_job(session, model="m", stream=CancelWhileReading(data, make_session), shard_size=4)
    assert job.status == JobStatus.CANCELLED and job.num_shards == 0
    assert job.request_counts == {"total": 20, "completed": 0, "failed": 0}
    codes = [orjson.loads(x)["error"]["code"]
             for x in export_results(session, job_id=job.id, kind="errors")]
    assert codes == ["batch_cancelled"] * 20
    assert shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60) is None
