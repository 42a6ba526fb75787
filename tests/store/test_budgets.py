"""A job's max_total_tokens on SQLite and PostgreSQL: refused when not a positive integer, never exceeded by
what is recorded; lines past it end with budget_exceeded, finished lines are kept, the job completes."""

from __future__ import annotations

import re

import orjson
import pytest
from sqlalchemy import select

from batchinfer.store import shards
from batchinfer.store.errors import JobError
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job
from batchinfer.store.models import Request, RequestStatus
from tests.store.helpers import chat_line, fake_results, jsonl, submit_job


def submit(session, count: int, **kwargs):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(count)]
    return submit_job(session, model="m", stream=jsonl(*lines), shard_size=4, **kwargs)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_a_budget_that_is_not_a_positive_integer_is_refused(session, bad):
    with pytest.raises(JobError, match="max_total_tokens must be an integer from 1"):
        submit(session, 2, max_total_tokens=bad)


def test_lines_past_the_budget_end_with_budget_exceeded_and_finished_lines_are_kept(session):
    job = submit(session, 12, max_total_tokens=50)  # fake results use 13 to 19 tokens a line
    lease = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
    pending = shards.pending_requests(session, shard_id=lease.shard_id)
    results = fake_results(pending)
    fitting = 0
    used = 0
    for result in results:
        if used + result["prompt_tokens"] + result["completion_tokens"] > 50:
            break
        used += result["prompt_tokens"] + result["completion_tokens"]
        fitting += 1
    assert 0 < fitting < 4
    shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=results)
    assert shards.claim_shard(session, worker_id="w2", model="m", lease_seconds=60) is None  # nothing left
    status = shards.complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)
    assert status == "completed"
    job = get_job(session, job_id=job.id)
    assert job.prompt_tokens + job.completion_tokens == used <= 50
    assert job.request_counts == {"total": 12, "completed": fitting, "failed": 12 - fitting}
    codes = session.scalars(select(Request.error_code).where(Request.job_id == job.id,
                                                             Request.status == RequestStatus.ERRORED)).all()
    assert codes == ["budget_exceeded"] * (12 - fitting)
    errors = [orjson.loads(line) for line in export_results(session, job_id=job.id, kind="errors")]
    assert len(errors) == 12 - fitting
    for error in errors:  # each names its own line, the budget and the fix
        message = error["error"]["message"]
        assert re.match(r"line \d+: .*max_total_tokens=50.*--max-total-tokens", message), message


def test_a_job_without_a_budget_records_everything(session):
    job = submit(session, 4)
    lease = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
    pending = shards.pending_requests(session, shard_id=lease.shard_id)
    assert shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                results=fake_results(pending)) == 4
    assert get_job(session, job_id=job.id).max_total_tokens is None
