"""A real `batchinfer worker --pipeline-parallel-size 2` (no broker: it polls SQLite) whose rank process is
killed with SIGKILL mid-job: the worker process exits with EXIT_ENGINE_LOST within the lease, naming the
dead rank on stderr, it leaves no shard running, and a plain `batchinfer worker` then completes the job
with every custom_id exactly once (ARCHITECTURE.md, contract 7)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest
from sqlalchemy import func, select

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.models import Request, Shard
from tests.acceptance.servers import wait_for
from tests.workers.helpers import write_requests
from workers.tasks import EXIT_ENGINE_LOST

pytestmark = pytest.mark.integration  # worker processes, their rank processes and a database
LEASE_S = 20  # the worker must be gone well within one lease of the kill
ENV = {
    "BATCHINFER_LEASE_SECONDS": str(LEASE_S),
    "BATCHINFER_DEVICE": "cpu",
    "BATCHINFER_MAX_NUM_SEQS": "2",  # a job of several batches: it is still running when the rank dies
    "BATCHINFER_KV_CACHE_MEMORY_BYTES": str(16 << 20),
    "BATCHINFER_WRITE_BATCH_SIZE": "2",
    "BATCHINFER_WRITE_INTERVAL_MS": "100",
    "BATCHINFER_WORKER_METRICS_PORT": "0",
    "OMP_NUM_THREADS": "1",
}


class Worker:
    """One `batchinfer worker` process in its own session, stdout and stderr in separate log files."""

    def __init__(self, tmp: Path, name: str, env: dict[str, str], *args: str) -> None:
        self.stderr_path = tmp / f"{name}.stderr"
        with (tmp / f"{name}.stdout").open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "worker", *args], env=env,
                                         stdout=out, stderr=err, cwd=tmp, start_new_session=True)

    def stderr(self) -> str:
        """Its stderr so far."""
        return self.stderr_path.read_text(errors="replace")

    def rank_processes(self) -> list[psutil.Process]:
        """Its pipeline rank processes (multiprocessing spawn children; not the resource tracker)."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [child for child in children if "spawn_main" in " ".join(child.cmdline())]

    def stop(self) -> None:
        """SIGTERM its process group if it still runs (SIGKILL after 20 s)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def test_sigkilled_rank_ends_the_pipeline_worker_and_a_plain_worker_completes_the_job(
        tmp_path: Path, tiny_llama: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'batchinfer.db'}"
    upgrade(database_url)
    env = {key: value for key, value in os.environ.items() if not key.startswith("BATCHINFER_")}
    env.update(ENV, BATCHINFER_DATA_DIR=str(tmp_path / "data"), BATCHINFER_DATABASE_URL=database_url,
               BATCHINFER_DEFAULT_MODEL=str(tiny_llama))
    path = tmp_path / "in.jsonl"
    ids = write_requests(path, 16, max_tokens=48)
    sessions = session_factory(database_url)
    with sessions() as session:
        job = submit_job(session, settings=Settings(database_url=database_url, data_dir=tmp_path / "data"),
                         path=path, model=str(tiny_llama), owner="t", shard_size=4)

    def finished() -> int:
        with sessions() as session:
            return session.scalar(select(func.count()).select_from(Request).where(
                Request.job_id == job.id, Request.status != "pending")) or 0

    def shard_statuses() -> list[str]:
        with sessions() as session:
            return list(session.scalars(select(Shard.status).where(Shard.job_id == job.id)))

    pipeline = Worker(tmp_path, "pipeline", env, "--pipeline-parallel-size", "2")
    plain = None
    try:
        wait_for(lambda: finished() >= 2 or pipeline.proc.poll() is not None, timeout=90, interval=0.1,
                 what="the pipeline worker's first results", on_timeout=pipeline.stderr)
        assert pipeline.proc.poll() is None, pipeline.stderr()
        (rank1,) = pipeline.rank_processes()
        rank1.kill()  # SIGKILL
        killed_at = time.monotonic()
        code = pipeline.proc.wait(timeout=LEASE_S)
        assert time.monotonic() - killed_at < LEASE_S
        stderr = pipeline.stderr()
        assert code == EXIT_ENGINE_LOST, stderr
        assert re.search(r"worker: pipeline-parallel rank 1 \(stage 1, tp rank 0\) \(exit code -9\) died.*"
                         r"its shards were handed back; exiting", stderr), stderr
        assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE
        assert "running" not in shard_statuses()  # handed back at once, not left to the lease
        assert finished() < len(ids), "the kill must land mid-job"

        plain = Worker(tmp_path, "plain", env)
        wait_for(lambda: get_status(sessions, job.id) in ("completed", "failed"), timeout=90, interval=0.2,
                 what="the plain worker to finish the job", on_timeout=plain.stderr)
    finally:
        for worker in (pipeline, plain):
            if worker is not None:
                worker.stop()
    with sessions() as session:
        assert get_job(session, job_id=job.id).status == "completed", plain.stderr()
        outputs = [orjson.loads(x) for x in export_results(session, job_id=job.id)]
        errors = [orjson.loads(x) for x in export_results(session, job_id=job.id, kind="errors")]
    assert sorted(o["custom_id"] for o in outputs) == ids and errors == []  # every custom_id exactly once


def get_status(sessions, job_id: int) -> str:
    """The job's status, read in a fresh session."""
    with sessions() as session:
        return get_job(session, job_id=job_id).status
