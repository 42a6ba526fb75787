"""Values a database column cannot take (NUL, ids past the column's range, windows past any date) never fail
more than the one line or call that carries them: a line-numbered error, or "not found", or a JobError.

Every test runs on SQLite and on PostgreSQL: PostgreSQL is where these used to be database errors (text
cannot hold NUL, INTEGER is 32-bit), SQLite must keep answering the same way.
"""

from __future__ import annotations

import io

import orjson
import pytest
from sqlalchemy import select

from batchinfer.store import files as file_store
from batchinfer.store import jobs
from batchinfer.store.errors import JobError, JobNotFound
from batchinfer.store.export import export_results
from batchinfer.store.ids import INT32_MAX, MAX_FILE_ID, MAX_JOB_ID
from batchinfer.store.models import File, JobStatus, Request, RequestStatus, Shard
from batchinfer.store.shards import claim_shard, complete_shard, pending_requests, write_results
from tests.store.helpers import fake_results, submit_job

NUL = "\x00"


def envelope(custom_id: object, body: dict, url: str = "/v1/chat/completions") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat(custom_id: object, content: str = "hello", **fields: object) -> bytes:
    return envelope(custom_id, {"messages": [{"role": "user", "content": content}], **fields})


# (line, None when it runs, or (param of its error, a fragment of the message))
NUL_LINES: list[tuple[bytes, tuple[str, str] | None]] = [
    (chat("ok-first"), None),
    (chat(f"a{NUL}b"), ("custom_id", "NUL character")),
    (orjson.dumps({"custom_id": f"short{NUL}hand", "prompt": "hi"}), ("custom_id", "NUL character")),
    (chat(f"dup{NUL}", temperature=9), ("custom_id", "NUL character")),  # NUL wins over other errors
    (chat("text-nul", content=f"he{NUL}llo"), None),  # stored escaped in the JSON payload: it runs
    (envelope("prompt-nul", {"prompt": f"x{NUL}y"}, url="/v1/completions"), None),
    (chat("stop-nul", stop=[f"a{NUL}"]), None),
    (chat("field-nul", **{f"bad{NUL}field": 1}), ("body.bad\\x00field", "unknown")),
    (envelope("role-nul", {"messages": [{"role": f"us{NUL}er", "content": "x"}]}),
     ("body.messages[0].role", "role")),
    (orjson.dumps({"custom_id": "env-nul", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": []}, f"x{NUL}": 1}), ("x\\x00", "unknown field")),
    (chat("meta-nul", metadata={"k": f"v{NUL}"}), None),
    (chat("ok-last"), None),
]


def nul_file() -> io.BytesIO:
    return io.BytesIO(b"".join(line + b"\n" for line, _ in NUL_LINES))


def test_a_nul_errors_its_line_only(session):
    job = submit_job(session, model="m", stream=nul_file())
    assert job.status == JobStatus.IN_PROGRESS, job.errors
    rows = {r.line_number: r for r in session.scalars(select(Request).where(Request.job_id == job.id))}
    assert sorted(rows) == list(range(1, len(NUL_LINES) + 1))
    listed = {error["line"]: error for error in job.errors or []}
    for number, (_, expected) in enumerate(NUL_LINES, start=1):
        row = rows[number]
        if expected is None:
            assert row.status == RequestStatus.PENDING, (number, row.error_message)
            continue
        param, fragment = expected
        assert row.status == RequestStatus.ERRORED, number
        assert row.error_message.startswith(f"line {number}: ") and fragment in row.error_message, row
        assert NUL not in row.error_message and NUL not in (row.custom_id or "")
        assert listed[number]["param"] == param, listed[number]
    assert rows[2].custom_id == "line-2"  # an unusable custom_id is replaced, as for any bad line


def test_nul_text_runs_and_comes_back_intact(session):
    job = submit_job(session, model="m", stream=nul_file())
    shard_ids = session.scalars(select(Shard.id).where(Shard.job_id == job.id)).all()
    for shard_id in shard_ids:
        lease = claim_shard(session, worker_id="w", shard_id=shard_id, lease_seconds=60)
        pending = pending_requests(session, shard_id=shard_id)
        results = fake_results(pending)
        for result, request in zip(results, pending, strict=True):
            text = request.prompt if request.prompt is not None else request.messages[0]["content"]
            result["choices"][0]["text"] = f"echo {text}"
        write_results(session, shard_id=shard_id, lease_token=lease.lease_token, results=results)
        complete_shard(session, shard_id=shard_id, lease_token=lease.lease_token)
    job = jobs.get_job(session, job_id=job.id)
    ran = sum(expected is None for _, expected in NUL_LINES)
    assert job.status == JobStatus.COMPLETED and job.request_counts["completed"] == ran
    out = {line["custom_id"]: line for line in map(orjson.loads, export_results(session, job_id=job.id))}
    assert out["text-nul"]["response"]["body"]["choices"][0]["message"]["content"] == f"echo he{NUL}llo"
    assert out["prompt-nul"]["response"]["body"]["choices"][0]["text"] == f"echo x{NUL}y"


@pytest.mark.parametrize("field", ["model", "idempotency_key"])
@pytest.mark.parametrize("value", [f"m{NUL}", "x" * 257, ""])
def test_a_model_or_key_the_column_cannot_hold_is_a_job_error(session, field, value):
    arguments = {"model": "m", field: value}
    with pytest.raises(JobError, match=field):
        submit_job(session, stream=io.BytesIO(chat("q") + b"\n"), **arguments)
    assert jobs.list_jobs(session) == []  # nothing was created


@pytest.mark.parametrize("job_id", [INT32_MAX + 1, 2**40, MAX_JOB_ID + 1, 10**18, 0, -1])
def test_an_id_beyond_the_column_is_not_found(session, job_id):
    job = submit_job(session, model="m", stream=io.BytesIO(chat("q") + b"\n"))
    assert jobs.get_job(session, job_id=job_id) is None
    with pytest.raises(JobNotFound):
        jobs.cancel_job(session, job_id=job_id)
    assert [j.id for j in jobs.list_jobs(session, after=job_id)] == ([job.id] if job_id > 1 else [])
    assert file_store.get_file(session, owner="", file_id=job_id) is None
    assert file_store.delete_file(session, owner="", file_id=job_id) is False
    assert file_store.list_files(session, owner="", after=job_id) == ([], False)


def test_the_id_bounds_follow_the_columns():
    # Every id column is 64-bit (migration 0005); a request key is job_id << 32 | line in a signed 64-bit
    # column, which caps job ids at 2**31 - 1 whatever jobs.id holds.
    assert MAX_JOB_ID == INT32_MAX
    assert MAX_FILE_ID == 2**63 - 1


def test_a_file_id_beyond_32_bits_is_stored_and_found(session):
    # On PostgreSQL the migrated files.id column and its sequence are BIGINT: an id past 2**31 round-trips.
    big = 2**40
    with session.begin():
        session.add(File(id=big, owner="", filename="big.jsonl", purpose="batch", bytes=0, path=""))
    found = file_store.get_file(session, owner="", file_id=big)
    assert found is not None and found.id == big


@pytest.mark.parametrize(("window", "says"), [
    ("99999999d", "longer than the maximum of 30d"),
    ("31d", "longer than the maximum of 30d"),
    ("2592001s", "longer than the maximum of 30d"),
    ("9" * 400 + "h", "longer than the maximum of 30d"),
    ("0h", "not valid"),
    ("24 hours", "not valid"),
])
def test_a_window_beyond_the_maximum_is_a_job_error(session, window, says):
    with pytest.raises(JobError, match=says):
        submit_job(session, model="m", stream=io.BytesIO(chat("q") + b"\n"), completion_window=window)
    assert jobs.list_jobs(session) == []


def test_the_longest_window_is_accepted_and_stored_canonically(session):
    job = submit_job(session, model="m", stream=io.BytesIO(chat("q") + b"\n"),
                     completion_window="0000000000000000000030d")
    assert job.completion_window == "30d"
    assert (job.expires_at - job.created_at).days == 30
