"""Errors decided after ingest (the worker's and the shard's) name the input line, as ingest errors do:
`line N: ...` (ARCHITECTURE.md, contract 8)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select

from batchinfer.config import Settings
from batchinfer.store.db import get_engine, session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import submit_job
from batchinfer.store.models import Request, RequestStatus
from batchinfer.store.shards import claim_shard, complete_shard, fail_shard, list_shards
from tests.workers.helpers import write_requests
from workers.process import make_runner, run_job


def _errors(url: str, job_id: int) -> dict[str, dict]:
    with session_factory(url)() as session:
        return {line["custom_id"]: line["error"]
                for line in map(orjson.loads, export_results(session, job_id=job_id, kind="errors"))}


def test_worker_side_request_errors_start_with_their_line(sqlite_url: str, tmp_path: Path,
                                                          tiny_llama: Path) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path)
    too_long = orjson.dumps({"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "the cat " * 400, "max_tokens": 4}})
    poison = orjson.dumps({"custom_id": "poison", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "poison " * 40, "max_tokens": 4}})
    write_requests(tmp_path / "in.jsonl", 3, extra_lines=[too_long, poison])  # lines 4 and 5
    with session_factory(sqlite_url)() as session:
        job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model=str(tiny_llama))
    runner = make_runner(model=str(tiny_llama), settings=settings, device="cpu",
                         kv_cache_memory_bytes=16 << 20)
    poison_len = len(runner.engine.tokenize("poison " * 40))
    real_execute = runner.engine.model_runner.execute_model

    def execute(scheduled, logits_counts=None, **options):  # noqa: ANN001, ANN003, ANN202 - fault injection
        if any(len(seq.token_ids) >= poison_len for seq, _ in scheduled):
            raise RuntimeError("simulated kernel failure")
        return real_execute(scheduled, logits_counts, **options)

    runner.engine.model_runner.execute_model = execute
    run_job(job_id=job.id, runner=runner)
    errors = _errors(sqlite_url, job.id)
    assert sorted(errors) == ["poison", "too-long"]
    assert errors["too-long"]["code"] == "invalid_request"
    assert errors["too-long"]["message"].startswith("line 4: prompt"), errors["too-long"]
    assert errors["poison"]["code"] == "engine_error"
    assert errors["poison"]["message"].startswith("line 5: the engine failed on this request"), errors


@pytest.fixture(params=["sqlite_url", pytest.param("pg_url", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    url = request.getfixturevalue(request.param)
    upgrade(url)
    yield url
    get_engine(url).dispose()


def _job(url: str, lines: int, **settings: object) -> int:
    body = b"".join(orjson.dumps({"custom_id": f"q{i}", "prompt": f"p{i}"}) + b"\n" for i in range(lines))
    with session_factory(url)() as session:
        return submit_job(session, settings=Settings(database_url=url, **settings), model="m",
                          stream=io.BytesIO(body)).id


def test_requests_a_shard_leaves_unanswered_name_their_line(url: str) -> None:
    job_id = _job(url, 3)
    with session_factory(url)() as session:
        shard = list_shards(session, job_id=job_id)[0]
        lease = claim_shard(session, worker_id="w", shard_id=shard.id, lease_seconds=60)
        complete_shard(session, shard_id=shard.id, lease_token=lease.lease_token)  # wrote no result
    errors = _errors(url, job_id)
    assert [(cid, e["code"]) for cid, e in errors.items()] == [(f"q{i}", "missing_result") for i in range(3)]
    assert [e["message"].split(": ", 1)[0] for e in errors.values()] == ["line 1", "line 2", "line 3"]


def test_requests_of_a_failed_shard_name_their_line(url: str) -> None:
    job_id = _job(url, 2, max_attempts=1)
    with session_factory(url)() as session:
        shard = list_shards(session, job_id=job_id)[0]
        lease = claim_shard(session, worker_id="w", shard_id=shard.id, lease_seconds=60)
        fail_shard(session, shard_id=shard.id, lease_token=lease.lease_token, error="model crashed")
        rows = session.execute(select(Request.line_number, Request.status, Request.error_message)
                               .where(Request.job_id == job_id).order_by(Request.line_number)).all()
    assert [(n, s) for n, s, _ in rows] == [(1, RequestStatus.ERRORED), (2, RequestStatus.ERRORED)]
    assert [m for _, _, m in rows] == [f"line {n}: model crashed (after 1 attempt(s))" for n in (1, 2)]
