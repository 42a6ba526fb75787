"""A worker over a pipeline-parallel engine whose rank is killed mid-job: the failure ends the worker's run
within seconds (never a hang, never every request errored), its shards go back to the queue, and another
worker completes the job with every custom_id exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select

from batchinfer.config import Settings
from batchinfer.engine.errors import RankFailedError
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.models import Shard
from tests.workers.helpers import write_requests
from workers.process import make_runner, run_job

pytestmark = pytest.mark.integration  # rank processes and a database
ENGINE = {"max_num_seqs": 4, "device": "cpu", "kv_cache_memory_bytes": 16 << 20}


def test_killed_rank_releases_the_shards_and_another_worker_completes_the_job(
        sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, write_batch_size=2)
    path = tmp_path / "in.jsonl"
    ids = write_requests(path, 12, max_tokens=40)
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        job = submit_job(session, settings=settings, path=path, model=str(tiny_llama), owner="t",
                         shard_size=4)
    pipeline = make_runner(model=str(tiny_llama), settings=settings, pipeline_parallel_size=2, **ENGINE)
    killed_at: list[float] = []

    def kill_a_rank(_finished: int, _tokens: int) -> None:
        if not killed_at:
            os.kill(pipeline.engine.model_runner.launcher.processes[0].pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    try:
        with pytest.raises(RankFailedError, match=r"rank 1 \(stage 1, tp rank 0\)") as failure:
            run_job(job_id=job.id, runner=pipeline, on_progress=kill_a_rank)
        assert killed_at, f"a rank died before the test killed one (see its stderr): {failure.value}"
        assert time.monotonic() - killed_at[0] < 10
    finally:
        pipeline.engine.close()
    with sessions() as session:
        statuses = session.scalars(select(Shard.status).where(Shard.job_id == job.id)).all()
        assert "running" not in statuses  # released at once, not left to the lease

    successor = make_runner(model=str(tiny_llama), settings=settings, **ENGINE)
    try:
        run_job(job_id=job.id, runner=successor)
    finally:
        successor.engine.close()
    with sessions() as session:
        assert get_job(session, job_id=job.id).status == "completed"
        outputs = [orjson.loads(x) for x in export_results(session, job_id=job.id)]
        errors = [orjson.loads(x) for x in export_results(session, job_id=job.id, kind="errors")]
    assert sorted(o["custom_id"] for o in outputs) == ids and errors == []
