"""The local mode: submit, run the shards in-process with ShardRunner on a real engine, export."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from tests.workers.helpers import read_lines, write_requests
from workers.process import make_runner, run_job


def _stored_sizes(sessions, job_id: int) -> tuple[int, int] | None:  # noqa: ANN001
    with sessions() as session:
        job = get_job(session, job_id=job_id)
        return None if job.error_bytes is None else (job.output_bytes, job.error_bytes)


def _round_trip(url: str, model: Path, tmp_path: Path) -> None:
    upgrade(url)
    settings = Settings(database_url=url, data_dir=tmp_path, write_batch_size=4)
    sessions = session_factory(url)
    input_path = tmp_path / "in.jsonl"
    ids = write_requests(input_path, 20, seeded=True, extra_lines=[b'{"custom_id": "bad", "body": 3}'])
    with sessions() as session:
        job = submit_job(session, settings=settings, path=input_path, model=str(model), owner="t",
                         shard_size=6)
    assert job.num_shards == 4
    runner = make_runner(model=str(model), settings=settings, max_num_seqs=8, device="cpu")
    stats = run_job(job_id=job.id, runner=runner)
    assert stats.shards_completed == 4
    assert not runner.engine.has_unfinished()
    with sessions() as session:
        job = get_job(session, job_id=job.id)
        assert job.status == "completed"
        assert job.request_counts == {"total": 21, "completed": 20, "failed": 1}
        assert job.completion_tokens > 0
        out = tmp_path / "out.jsonl"
        out.write_bytes(b"".join(export_results(session, job_id=job.id)))
        errors = b"".join(export_results(session, job_id=job.id, kind="errors"))
    lines = read_lines(out)
    assert [line["custom_id"] for line in lines] == ids  # each exactly once, in input order
    deadline = time.monotonic() + 30  # the runner that ended the job sized its files once (GET /v1/files)
    while (sizes := _stored_sizes(sessions, job.id)) is None:
        assert time.monotonic() < deadline, "the runner did not store the result files' sizes"
        time.sleep(0.02)
    assert sizes == (len(out.read_bytes()), len(errors))
    for i, line in enumerate(lines):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] <= 6 + (i % 3)  # max_tokens respected
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert b"line 21" in errors

    # Seeded sampling is reproducible: the same file again gives the same texts.
    with sessions() as session:
        again = submit_job(session, settings=settings, path=input_path, model=str(model), owner="t",
                           shard_size=20)
    run_job(job_id=again.id, runner=runner)
    with sessions() as session:
        second = [orjson.loads(line)["response"]["body"]["choices"][0]["message"]["content"]
                  for line in export_results(session, job_id=again.id)]
    assert second == [line["response"]["body"]["choices"][0]["message"]["content"] for line in lines]


def test_round_trip_sqlite(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    _round_trip(sqlite_url, tiny_llama, tmp_path)


@pytest.mark.postgres
def test_round_trip_postgres(pg_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    _round_trip(pg_url, tiny_llama, tmp_path)
