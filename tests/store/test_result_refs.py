"""Result bodies by reference (issue 31), on SQLite and PostgreSQL: a cacheable success's row keeps no copy
of its body, export renders it from `result_bodies` exactly as a copy would read, a referenced body is
pinned against eviction and the retention purge, and a refresh never changes an earlier job's output."""

from __future__ import annotations

import hashlib
import threading
from datetime import timedelta

import orjson
import pytest
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store import result_cache as cache_store
from batchinfer.store import shards
from batchinfer.store.db import session_factory, upgrade, write_transaction
from batchinfer.store.export import export_results
from batchinfer.store.models import Job, Request, ResultBody, utcnow
from batchinfer.store.result_files import record_result_sizes
from batchinfer.store.retention import purge
from batchinfer.wire.result_row import BodyRef
from tests.store.helpers import chat_line, jsonl, submit_job


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _body(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
            "prompt_tokens": 11, "completion_tokens": 2, "cached_tokens": 4, "model": "m"}


def _run(session: Session, answers: list[tuple[str, int | None]], *, result_cache: str = "use") -> Job:
    """A job of one line per answer, every line answered: (text, the job that computed it: None for this job,
    -1 for no reference at all, as an uncacheable success is written)."""
    lines = [chat_line(f"c{i}", f"question {i}") for i in range(len(answers))]
    job = submit_job(session, model="m", stream=jsonl(*lines), result_cache=result_cache, shard_size=64)
    lease = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
    assert lease is not None and lease.job_id == job.id
    rows = []
    for request in shards.pending_requests(session, shard_id=lease.shard_id):  # shards run in prefix order
        text, computed_in = answers[request.line_number - 1]
        source = "miss" if computed_in in (None, -1) else "hit"
        row = {**_body(text), "request_id": request.request_id, "provenance": {"result_cache": source}}
        if computed_in != -1:
            row["result_body"] = BodyRef(_key(text), orjson.dumps(_body(text)),
                                         job.id if computed_in is None else computed_in)
        rows.append(row)
    shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=rows)
    shards.complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)
    return session.get(Job, job.id, populate_existing=True)


def _bodies(session: Session, job: Job) -> list[dict]:
    return [orjson.loads(line)["response"]["body"] for line in export_results(session, job_id=job.id)]


def _texts(session: Session, job: Job) -> list[str]:
    return [body["choices"][0]["message"]["content"] for body in _bodies(session, job)]


def _copy_bytes(session: Session, job: Job) -> int:
    """Bytes of response bodies the job's own rows hold."""
    return int(session.scalar(select(func.coalesce(func.sum(func.length(Request.response)), 0))
                              .where(Request.job_id == job.id)) or 0)


def test_a_cached_success_keeps_no_copy_and_reads_as_one(session: Session) -> None:
    answers = [("same answer", None)] * 4 + [("another", None), ("not cacheable", -1)]
    by_ref = _run(session, answers)
    copies = _run(session, [(text, -1) for text, _ in answers])  # the same results, each row a copy
    rows = session.execute(select(Request.response, Request.result_key).where(Request.job_id == by_ref.id)
                           .order_by(Request.id)).all()
    assert [key for _, key in rows] == [_key("same answer")] * 4 + [_key("another"), None]
    assert [response is None for response, _ in rows] == [True] * 5 + [False]
    stored = session.scalar(select(func.sum(ResultBody.size)))
    assert cache_store.cache_size(session) == (2, stored)  # one body per key, whatever uses it
    assert _copy_bytes(session, by_ref) * 5 < _copy_bytes(session, copies)  # one copy left of six
    # the rendered lines equal the copies' but for the ids and created time that name each line
    for ref_body, copy_body, line in zip(_bodies(session, by_ref), _bodies(session, copies),
                                         export_results(session, job_id=by_ref.id), strict=True):
        request_id = int(orjson.loads(line)["id"].removeprefix("batch_req_"))
        assert ref_body["id"] == f"chatcmpl-batch-{request_id}"
        assert abs(ref_body["created"] - copy_body["created"]) <= 5
        assert {**ref_body, "id": None, "created": None} == {**copy_body, "id": None, "created": None}
    finished = session.scalar(select(Request.finished_at).where(Request.job_id == by_ref.id).limit(1))
    assert _bodies(session, by_ref)[0]["created"] == int(finished.timestamp())
    # the owner is charged the rendered output, as for copies (ids of equal length: equal bytes)
    sizes = [record_result_sizes(session, job_id=job.id).output_bytes for job in (by_ref, copies)]
    assert sizes[0] == sum(map(len, export_results(session, job_id=by_ref.id))) == sizes[1]


def test_referenced_bodies_are_pinned_until_their_rows_go(session: Session, tmp_path) -> None:
    job = _run(session, [(f"answer {i}", None) for i in range(3)])
    later = utcnow() + timedelta(hours=2)
    assert cache_store.evict(session, max_bytes=0) == 0  # every body is referenced: none may go
    assert cache_store.purge_unused(session, older_than_s=60, now=later) == 0
    count, size = cache_store.cache_size(session)
    assert count == 3 and cache_store.cache_size(session, pinned=True) == (count, size)  # over the bound
    assert _texts(session, job) == [f"answer {i}" for i in range(3)]
    # the job's retention ends: its rows go first, then its bodies are unused and old enough to go too
    settings = Settings(data_dir=tmp_path, finished_job_retention_seconds=3600)
    report = purge(session, settings=settings, now=later)
    assert report.jobs == [job.id] and report.result_bodies == 3
    assert cache_store.cache_size(session) == (0, 0)


def test_eviction_takes_unreferenced_bodies_only(session: Session) -> None:
    job = _run(session, [("kept", None)])
    with write_transaction(session):
        cache_store.attach_bodies(session, refs=[BodyRef(_key(f"free {i}"), orjson.dumps(_body("x")), 99)
                                                 for i in range(3)], job_id=99, refresh=False)
    assert cache_store.evict(session, max_bytes=1) == 3
    assert list(cache_store.lookup(session, keys=[_key("kept")])) == [_key("kept")]
    assert _texts(session, job) == ["kept"]


def test_an_evicted_body_is_stored_again_by_the_row_that_was_served_it(session: Session) -> None:
    first = _run(session, [("served", None)])
    cache_store.lookup(session, keys=[_key("served")])  # a worker looked it up ...
    with write_transaction(session):
        session.execute(delete(Request).where(Request.job_id == first.id))  # (the rows pinning it gone)
    assert cache_store.evict(session, max_bytes=0) == 1  # ... and it was evicted before the hit was written
    hit = _run(session, [("served", first.id)])
    assert session.scalar(select(Request.response).where(Request.job_id == hit.id)) is None
    assert _texts(session, hit) == ["served"]


def test_refresh_never_changes_an_earlier_jobs_output(session: Session) -> None:
    night1 = _run(session, [("old answer", None), ("unchanged", None)])
    key = _key("old answer")  # a refresh job computes this very key again: its body replaces night 1's
    line = chat_line("c0", "question 0")
    again = submit_job(session, model="m", stream=jsonl(line), result_cache="refresh")
    lease = shards.claim_shard(session, worker_id="w", model="m", lease_seconds=60)
    assert lease is not None and lease.job_id == again.id
    (request,) = shards.pending_requests(session, shard_id=lease.shard_id)
    shards.write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=[
        {**_body("recomputed"), "request_id": request.request_id, "provenance": {"result_cache": "miss"},
         "result_body": BodyRef(key, orjson.dumps(_body("recomputed")), again.id)}])
    shards.complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)
    assert _texts(session, night1) == ["old answer", "unchanged"]  # night 1 reads what it read
    assert _texts(session, again) == ["recomputed"]
    found = cache_store.lookup(session, keys=[key])
    assert found[key].computed_in == again.id  # later jobs are served the refreshed body
    referencing = select(func.count()).select_from(Request)
    assert session.scalar(referencing.where(Request.result_key == key)) == 1
    archived = cache_store.archive_key(key, night1.id)  # night 1's rows moved with the old body
    assert session.scalar(referencing.where(Request.result_key == archived)) == 1

    # a hit looked up before the refresh and written after it keeps its own copy of what it was served
    late = _run(session, [("old answer", night1.id)])
    assert session.scalar(select(Request.result_key).where(Request.job_id == late.id)) is None
    assert _texts(session, late) == ["old answer"]


def test_migration_0013_writes_bodies_back_and_drops_stale_keys(db_url: str, session: Session) -> None:
    from alembic import command

    from batchinfer.store.db import alembic_config

    job = _run(session, [("a referenced answer", None), ("its own copy", -1)])
    before = list(export_results(session, job_id=job.id))
    session.close()
    command.downgrade(alembic_config(db_url), "0012")  # older code reads only `response`: bodies written back
    rows = session.execute(select(Request.response, Request.result_key).where(Request.job_id == job.id)).all()
    assert all(response is not None and key is None for response, key in rows)
    assert list(export_results(session, job_id=job.id)) == before
    with write_transaction(session):  # what a 0012 worker wrote: a copy beside the key
        session.execute(update(Request).where(Request.job_id == job.id).values(result_key=_key("x")))
    session.close()
    command.upgrade(alembic_config(db_url), "head")  # the copy is the row's output: its key pinned nothing
    assert session.scalars(select(Request.result_key).where(Request.job_id == job.id)).all() == [None, None]
    assert list(export_results(session, job_id=job.id)) == before


@pytest.mark.postgres
def test_eviction_skips_a_body_a_writer_holds_instead_of_waiting(pg_url: str) -> None:
    upgrade(pg_url)
    sessions = session_factory(pg_url)
    ref = BodyRef(_key("held"), orjson.dumps(_body("held")), 1)
    with sessions() as writer, sessions() as evictor:
        with write_transaction(writer):
            cache_store.attach_bodies(writer, refs=[ref], job_id=1, refresh=False,
                                      now=utcnow() - timedelta(hours=1))
        writer.begin()  # a worker's write: the body is touched (locked) and rows will reference it
        cache_store.attach_bodies(writer, refs=[ref], job_id=2, refresh=False)
        evicted: list[int] = []
        thread = threading.Thread(target=lambda: evicted.append(cache_store.evict(evictor, max_bytes=0)))
        thread.start()
        thread.join(timeout=20)
        waited = thread.is_alive()  # blocked on the writer's lock (what SKIP LOCKED avoids)
        writer.commit()
        thread.join()
        assert not waited and evicted == [0]  # skipped at once: a body about to be referenced stays
        assert cache_store.evict(evictor, max_bytes=0) == 1  # free again: nothing references it
