"""ETA from measured throughput: from the first finished requests on, clocked from the first shard claim.

The batch object's `progress` carries it over REST; `submit --wait` without a terminal prints it in a
one-line update every --update-interval seconds; `run` measures it locally the same way.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from rich.console import Console

from batchinfer.api.app import create_app
from batchinfer.cli import main
from batchinfer.cli.progress import JobProgress
from batchinfer.config import Settings
from batchinfer.store.apikeys import create_key
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.jobs import submit_job
from batchinfer.store.models import Job, JobStatus
from batchinfer.store.serialize import batch_object, estimate_eta_seconds
from batchinfer.store.shards import claim_shard, pending_requests, write_results
from tests.api.helpers import FixedOutputWorker
from tests.workers.helpers import write_requests

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def _job(**fields: object) -> Job:
    values: dict[str, object] = dict(
        id=7, owner="t", model="m", endpoint=None, status=JobStatus.IN_PROGRESS, input_file_id=None,
        completion_window="24h", errors=None, meta=None, num_errors=0, total_requests=100,
        completed_requests=0, failed_requests=0, prompt_tokens=0, completion_tokens=0, cached_tokens=0,
        created_at=NOW - timedelta(hours=1), in_progress_at=NOW - timedelta(hours=1))
    values.update(fields)
    return Job(**values)


def test_eta_is_measured_from_the_first_claim_not_from_the_queue_wait() -> None:
    # Waited an hour for a worker, then ran 20 requests in 10 s: 80 left at 2/s is 40 s, not ~4 hours.
    job = _job(completed_requests=20, completion_tokens=2000)
    progress = batch_object(job, now=NOW, started_at=NOW - timedelta(seconds=10))["progress"]
    assert progress["eta_seconds"] == 40.0
    assert progress["requests_per_second"] == 2.0 and progress["tokens_per_second"] == 200.0
    assert progress["started_at"] == int((NOW - timedelta(seconds=10)).timestamp())
    # Without the claim time (an older caller) the clock falls back to in_progress_at.
    assert batch_object(job, now=NOW)["progress"]["eta_seconds"] == pytest.approx(3600 * 80 / 20, rel=1e-6)


def test_no_eta_before_the_first_finished_request_and_ingest_errors_are_not_throughput() -> None:
    started = NOW - timedelta(seconds=30)
    assert batch_object(_job(), now=NOW, started_at=started)["progress"]["eta_seconds"] is None
    # 10 lines failed at ingest (num_errors): only the 20 the workers finished measure the pace.
    job = _job(completed_requests=20, failed_requests=10, num_errors=10)
    assert batch_object(job, now=NOW, started_at=started)["progress"]["eta_seconds"] == 30.0 * 70 / 20
    only_bad_lines = _job(failed_requests=10, num_errors=10)
    assert batch_object(only_bad_lines, now=NOW, started_at=started)["progress"]["eta_seconds"] is None
    finished = _job(status=JobStatus.COMPLETED, completed_requests=100, completed_at=NOW)
    assert batch_object(finished, now=NOW, started_at=started)["progress"]["eta_seconds"] is None
    assert estimate_eta_seconds(done=0, remaining=5, elapsed_s=3.0) is None
    assert estimate_eta_seconds(done=5, remaining=0, elapsed_s=3.0) == 0.0


def test_rest_batch_progress_carries_the_eta_once_requests_finished(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path / "data", shard_size=4)
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        key, _ = create_key(session, name="alice", owner="alice")
        write_requests(tmp_path / "in.jsonl", 12)
        job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model="m", owner="alice")
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(settings, status_cache_ttl_s=0)) as client:
        before = client.get(f"/v1/batches/batch_{job.id}", headers=headers).json()["progress"]
        assert before["eta_seconds"] is None and before["started_at"] is None  # nothing claimed yet
        claimed_at = datetime.now(UTC) - timedelta(seconds=6)
        with sessions() as session:
            lease = claim_shard(session, worker_id="w", model="m", lease_seconds=60, now=claimed_at)
            requests = pending_requests(session, shard_id=lease.shard_id)[:3]
            write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token, results=[
                {"request_id": r.request_id, "prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0,
                 "choices": [{"text": "ok", "finish_reason": "stop"}]} for r in requests])
        progress = client.get(f"/v1/batches/batch_{job.id}", headers=headers).json()["progress"]
        listed = client.get("/v1/batches", headers=headers).json()["data"][0]["progress"]
    assert progress["started_at"] == int(claimed_at.timestamp())
    # 3 done in ~6 s since the claim, 9 left: ~18 s at the measured pace.
    assert progress["eta_seconds"] == pytest.approx(18.0, abs=1.5)
    assert progress["requests_per_second"] == pytest.approx(0.5, abs=0.05)
    assert listed["eta_seconds"] == pytest.approx(progress["eta_seconds"], abs=1.5)  # the list says the same


@pytest.mark.integration  # a SQLite database and a worker thread
def test_submit_wait_without_a_terminal_prints_periodic_lines(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_SHARD_SIZE", "4")
    write_requests(tmp_path / "in.jsonl", 24)
    settings = Settings()
    (tmp_path / "data").mkdir()
    upgrade(settings.effective_database_url)
    with FixedOutputWorker(session_factory(settings.effective_database_url), model="fixed", delay_s=0.1):
        result = CliRunner().invoke(main, ["submit", str(tmp_path / "in.jsonl"), "-m", "fixed", "--wait",
                                           "--update-interval", "0.5"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("batch_")]
    assert len(lines) >= 3, result.stderr  # ~2.4 s of work, a line every 0.5 s, and the last one
    pattern = re.compile(r"batch_\d+ (in_progress|finalizing|completed): \d+/24 requests \(\d+\.\d%\), "
                         r"[\d,.]+ tok/s, elapsed \d+:\d\d:\d\d, "
                         r"ETA (\d+:\d\d:\d\d|unknown until requests finish)")
    assert all(pattern.fullmatch(line) for line in lines), lines
    assert any(re.search(r"ETA \d+:\d\d:\d\d$", line) for line in lines[:-1]), lines  # measured mid-run
    assert lines[-1].startswith("batch_1 completed: 24/24") and lines[-1].endswith("ETA 0:00:00"), lines[-1]
    assert "\x1b[" not in result.stderr  # no bar redraws in a log file


def test_local_progress_measures_its_own_eta() -> None:
    console = Console(file=open("/dev/null", "w"), force_terminal=False)  # noqa: SIM115 - closed with it
    with JobProgress(total=10, console=console, interval_s=3600, label="batch_9") as bar:
        assert bar.eta_seconds is None
        bar._started -= 4.0  # four seconds in, two requests done: 8 left at 0.5/s
        bar.advance(2, 40)
        assert bar.eta_seconds == pytest.approx(16.0, abs=0.1)
        assert bar.line().startswith("batch_9 running: 2/10 requests (20.0%), 10.0 tok/s")
        assert bar.line().endswith("ETA 0:00:16")
    console.file.close()
