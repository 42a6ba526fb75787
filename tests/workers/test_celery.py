"""Celery workers on the real Redis and PostgreSQL: sharing a job, crashes, duplicates, cancel, broker loss.

Workers are real `batchinfer worker` processes (Celery, solo pool) on the tiny model.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import cancel_job, get_job
from batchinfer.store.models import Request, Shard
from tests.workers.helpers import read_lines, write_requests
from workers.app import RUN_SHARD, create_celery_app, queue_name
from workers.dispatch import rescue_and_redispatch, submit_and_announce

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


class Cluster:
    """A PostgreSQL database, a Redis broker, and worker processes started on demand."""

    def __init__(self, pg_url: str, redis_url: str, model: Path, tmp_path: Path, lease_seconds: float = 4.0):
        self.env = {
            **os.environ,
            "BATCHINFER_DATABASE_URL": pg_url,
            "BATCHINFER_BROKER_URL": redis_url,
            "BATCHINFER_DEFAULT_MODEL": str(model),
            "BATCHINFER_DATA_DIR": str(tmp_path),
            "BATCHINFER_DEVICE": "cpu",
            "BATCHINFER_MAX_NUM_SEQS": "4",
            "BATCHINFER_KV_CACHE_MEMORY_BYTES": str(16 << 20),
            "BATCHINFER_LEASE_SECONDS": str(lease_seconds),
            "BATCHINFER_WRITE_BATCH_SIZE": "2",
            "BATCHINFER_WRITE_INTERVAL_MS": "100",
        }
        self.settings = Settings(database_url=pg_url, broker_url=redis_url, data_dir=tmp_path,
                                 lease_seconds=lease_seconds, default_model=str(model))
        self.model = str(model)
        self.tmp_path = tmp_path
        self.sessions = session_factory(pg_url)
        self.app = create_celery_app(self.settings)
        self.procs: list[subprocess.Popen] = []
        upgrade(pg_url)

    def start_worker(self, name: str) -> subprocess.Popen:
        log = (self.tmp_path / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "worker", "--log-level", "info"],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def submit(self, count: int, *, shard_size: int, max_tokens: int = 6,
               body_of: Callable[[int], dict] | None = None) -> tuple[int, list[str]]:
        path = self.tmp_path / f"in-{time.monotonic_ns()}.jsonl"
        ids = write_requests(path, count, max_tokens=max_tokens, body_of=body_of)
        with self.sessions() as session:
            job = submit_and_announce(session=session, settings=self.settings, app=self.app, path=path,
                                      model=self.model, owner="t", shard_size=shard_size)
        return job.id, ids

    def job(self, job_id: int):  # noqa: ANN201
        with self.sessions() as session:
            return get_job(session, job_id=job_id)

    def wait_status(self, job_id: int, statuses: set[str], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.job(job_id).status
            if status in statuses:
                return status
            for proc in self.procs:
                assert proc.poll() is None or proc.returncode in (0, -9, -15), self.logs()
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} stayed {self.job(job_id).status}\n{self.logs()}")

    def wait_completed(self, job_id: int, count: int, timeout: float = 60) -> None:
        """Wait until `count` requests of the job have results (the job is mid-flight)."""
        deadline = time.monotonic() + timeout
        while self.job(job_id).request_counts["completed"] < count:
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.05)

    def results(self, job_id: int) -> list[dict]:
        out = self.tmp_path / f"out-{job_id}.jsonl"
        with self.sessions() as session:
            out.write_bytes(b"".join(export_results(session, job_id=job_id))
                            + b"".join(export_results(session, job_id=job_id, kind="errors")))
        return read_lines(out)

    def shards(self, job_id: int) -> list[Shard]:
        with self.sessions() as session:
            return list(session.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.id)))

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.tmp_path.glob("*.log"))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def cluster(pg_url: str, redis_url: str, tiny_llama: Path, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(pg_url, redis_url, tiny_llama, tmp_path)
    try:
        yield c
    finally:
        c.stop()


def _wait_workers_ready(cluster: Cluster, count: int, timeout: float = 90) -> None:
    """Workers register in the database at start and log "ready" once Celery consumes."""
    from batchinfer.store.workers import list_workers

    deadline = time.monotonic() + timeout
    logs = [cluster.tmp_path / f"w{i}.log" for i in range(count)]
    while time.monotonic() < deadline:
        with cluster.sessions() as session:
            registered = len(list_workers(session))
        if registered >= count and all(log.exists() and " ready." in log.read_text() for log in logs):
            return
        time.sleep(0.3)
    raise AssertionError("workers did not start\n" + cluster.logs())


def test_two_workers_split_a_job_without_overlap_or_gap(cluster: Cluster) -> None:
    cluster.start_worker("w0")
    cluster.start_worker("w1")
    _wait_workers_ready(cluster, 2)
    job_id, ids = cluster.submit(64, shard_size=4, max_tokens=12)
    assert cluster.wait_status(job_id, {"completed"}) == "completed"
    lines = cluster.results(job_id)
    assert sorted(line["custom_id"] for line in lines) == ids  # no gap, no duplicate
    assert all(line["response"]["status_code"] == 200 for line in lines)
    shards = cluster.shards(job_id)
    assert all(s.status == "completed" and s.attempt == 1 for s in shards)  # each shard ran once
    assert len({s.lease_owner for s in shards}) == 2, "both workers should have taken shards"

    # A duplicate delivery of a finished shard is a no-op.
    cluster.app.send_task(RUN_SHARD, args=[shards[0].id], queue=queue_name(cluster.model))
    time.sleep(3)
    assert [s.attempt for s in cluster.shards(job_id)] == [1] * len(shards)
    assert sorted(line["custom_id"] for line in cluster.results(job_id)) == ids


def test_kill_9_mid_shard_then_rescue_completes_exactly_once(cluster: Cluster) -> None:
    victim = cluster.start_worker("w0")
    _wait_workers_ready(cluster, 1)
    # The first shard's requests are short, the other two shards' long (400 tokens each, no early EOS):
    # once results exist, seconds of work are still in flight, however late the kill comes (with 48
    # tokens each, a loaded run once saw all 24 finish before it).
    job_id, ids = cluster.submit(24, shard_size=8, body_of=lambda i: {"max_tokens": 4} if i < 8 else
                                 {"max_tokens": 400, "ignore_eos": True})
    cluster.wait_completed(job_id, 2)  # some results written, more in flight
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    done_at_crash = cluster.job(job_id).request_counts["completed"]
    assert done_at_crash < 24
    cluster.start_worker("w1")
    time.sleep(cluster.settings.lease_seconds + 0.5)
    rescue_and_redispatch(app=cluster.app, settings=cluster.settings)  # what beat does periodically
    assert cluster.wait_status(job_id, {"completed"}) == "completed"
    lines = cluster.results(job_id)
    assert sorted(line["custom_id"] for line in lines) == ids
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert max(s.attempt for s in cluster.shards(job_id)) == 2  # the crashed shard ran again


def test_cancel_mid_job_keeps_finished_results(cluster: Cluster) -> None:
    cluster.start_worker("w0")
    _wait_workers_ready(cluster, 1)
    job_id, ids = cluster.submit(40, shard_size=4, max_tokens=64)
    cluster.wait_completed(job_id, 2)
    with cluster.sessions() as session:
        cancel_job(session, job_id=job_id, owner="t")
    assert cluster.wait_status(job_id, {"cancelled"}, timeout=30) == "cancelled"
    job = cluster.job(job_id)
    lines = cluster.results(job_id)
    succeeded = [line for line in lines if line["error"] is None]
    assert len(succeeded) == job.request_counts["completed"] >= 2
    assert sorted(line["custom_id"] for line in lines) == ids  # the rest are reported as cancelled
    assert {line["error"]["code"] for line in lines if line["error"]} <= {"batch_cancelled"}
    with cluster.sessions() as session:
        pending = session.scalars(select(Request).where(Request.job_id == job_id,
                                                        Request.status == "pending")).all()
    assert not pending


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server binary not installed")
def test_broker_restart_mid_job_loses_nothing(pg_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    # A private Redis without persistence, so restarting it really drops every queued message.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redis_cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no"]
    redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    c = Cluster(pg_url, f"redis://127.0.0.1:{port}/0", tiny_llama, tmp_path)
    try:
        c.start_worker("w0")
        _wait_workers_ready(c, 1)
        job_id, ids = c.submit(32, shard_size=4, max_tokens=24)
        c.wait_completed(job_id, 2)
        redis.terminate()
        redis.wait()
        time.sleep(1)
        redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)
        time.sleep(1)
        rescue_and_redispatch(app=c.app, settings=c.settings)  # beat's periodic pass re-announces
        deadline = time.monotonic() + 120
        while c.job(job_id).status != "completed":
            assert time.monotonic() < deadline, c.logs()
            time.sleep(2)
            rescue_and_redispatch(app=c.app, settings=c.settings)
        assert sorted(line["custom_id"] for line in c.results(job_id)) == ids
    finally:
        c.stop()
        redis.terminate()
        redis.wait()
