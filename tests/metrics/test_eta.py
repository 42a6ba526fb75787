"""ETA from measured throughput in tokens, clocked from the first shard claim (store.progress).

Tokens count finished requests and in-flight ones (the workers' shard heartbeats), and what is left comes
from the requests' max_tokens budgets scaled by the share finished requests used. The batch object's
`progress` carries it over REST; `submit --wait` without a terminal prints it in a one-line update every
--update-interval seconds; `run` follows the same figures from its database.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
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
from batchinfer.store.progress import InflightReport, estimate
from batchinfer.store.serialize import batch_object
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
    progress = batch_object(job, now=NOW, started_at=NOW - timedelta(seconds=10)).progress.model_dump()
    assert progress["eta_seconds"] == 40.0
    assert progress["requests_per_second"] == 2.0 and progress["tokens_per_second"] == 200.0
    assert progress["started_at"] == int((NOW - timedelta(seconds=10)).timestamp())
    # Without the claim time (an older caller) the clock falls back to in_progress_at.
    assert batch_object(job, now=NOW).progress.eta_seconds == pytest.approx(3600 * 80 / 20, rel=1e-6)


def test_no_eta_before_the_first_finished_request_and_ingest_errors_are_not_throughput() -> None:
    started = NOW - timedelta(seconds=30)
    assert batch_object(_job(), now=NOW, started_at=started).progress.eta_seconds is None
    # 10 lines failed at ingest (num_errors): only the 20 the workers finished measure the pace.
    job = _job(completed_requests=20, failed_requests=10, num_errors=10)
    assert batch_object(job, now=NOW, started_at=started).progress.eta_seconds == 30.0 * 70 / 20
    only_bad_lines = _job(failed_requests=10, num_errors=10)
    assert batch_object(only_bad_lines, now=NOW, started_at=started).progress.eta_seconds is None
    finished = _job(status=JobStatus.COMPLETED, completed_requests=100, completed_at=NOW)
    assert batch_object(finished, now=NOW, started_at=started).progress.eta_seconds is None
    nothing = InflightReport()
    assert estimate(total=5, done=0, worker_done=0, finished_tokens=0, inflight=nothing, elapsed_s=3.0,
                    running=True).eta_seconds is None
    assert estimate(total=5, done=5, worker_done=5, finished_tokens=50, inflight=nothing, elapsed_s=3.0,
                    running=True).remaining_tokens == 0


def test_in_flight_tokens_give_an_eta_before_any_request_finished() -> None:
    # Issue 29 item 5: 30 requests side by side finish together at the end; counting finished requests
    # only gave 0 tok/s and no ETA for most of the run. 10 s in, each generated 32 of its 64 tokens.
    job = _job(total_requests=30)
    inflight = InflightReport(requests=30, tokens=30 * 32, budget=30 * 64)
    started = NOW - timedelta(seconds=10)
    progress = batch_object(job, now=NOW, started_at=started, inflight=inflight).progress.model_dump()
    assert progress["generated_tokens"] == 960 and progress["tokens_per_second"] == 96.0
    assert progress["remaining_tokens"] == 960 and progress["eta_seconds"] == 10.0
    # Without the in-flight report it would know nothing yet.
    assert batch_object(job, now=NOW, started_at=started).progress.eta_seconds is None


def test_finished_requests_say_how_much_of_their_budget_the_unclaimed_ones_will_use() -> None:
    # Finished requests used 20 of their 100-token budgets (they stopped at EOS): the 10 unclaimed are
    # expected to use a fifth of theirs too; the 10 in flight (10 tokens each so far) outlived them, so
    # their budget left counts in full.
    measured = estimate(total=30, done=10, worker_done=10, finished_tokens=200,
                        inflight=InflightReport(requests=10, tokens=100, budget=1000), elapsed_s=10.0,
                        running=True)
    assert measured.generated_tokens == 300 and measured.tokens_per_second == 30.0
    assert measured.remaining_tokens == 900 + 10 * 100 * 0.2  # 1100
    assert measured.eta_seconds == pytest.approx(1100 / 30, abs=0.1)


def test_a_tail_of_long_requests_is_timed_by_its_longest_not_by_the_average_throughput() -> None:
    # 2 requests left, 150 tokens each to go: at 300 tok/s on average that reads 1 s, but one sequence
    # grows one token per engine step; at 20 steps/s the longest needs 7.5 s (the worker's critical_s).
    tail = InflightReport(requests=2, tokens=100, budget=400, critical_s=7.5)
    measured = estimate(total=40, done=38, worker_done=38, finished_tokens=2900, inflight=tail,
                        elapsed_s=10.0, running=True)
    assert measured.remaining_tokens == 300 and measured.eta_seconds == 7.5


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
        asked = datetime.now(UTC)
        progress = client.get(f"/v1/batches/batch_{job.id}", headers=headers).json()["progress"]
        answered = datetime.now(UTC)
        listed = client.get("/v1/batches", headers=headers).json()["data"][0]["progress"]
        listed_at = datetime.now(UTC)
    assert progress["started_at"] == int(claimed_at.timestamp())
    # 3 done (5 tokens each) in the time since the claim (6 s and what this test took since, measured: a
    # loaded machine stretches it), 9 left at that pace: ETA = 3 x elapsed, 3 / elapsed requests a second.
    slack = 0.1  # seconds: the server read its clock between ours
    low, high = ((moment - claimed_at).total_seconds() for moment in (asked, answered))
    assert 3 * (low - slack) <= progress["eta_seconds"] <= 3 * (high + slack)
    assert 3 / (high + slack) - 0.005 <= progress["requests_per_second"] <= 3 / (low - slack) + 0.005
    listed_high = (listed_at - claimed_at).total_seconds()
    assert 3 * (low - slack) <= listed["eta_seconds"] <= 3 * (listed_high + slack)  # the list says the same


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
                         r"ETA (\d+:\d\d:\d\d|unknown until tokens are generated)")
    assert all(pattern.fullmatch(line) for line in lines), lines
    assert any(re.search(r"ETA \d+:\d\d:\d\d$", line) for line in lines[:-1]), lines  # measured mid-run
    assert lines[-1].startswith("batch_1 completed: 24/24") and lines[-1].endswith("ETA 0:00:00"), lines[-1]
    assert "\x1b[" not in result.stderr  # no bar redraws in a log file


def test_local_progress_shows_the_measured_figures_and_follows_them() -> None:
    console = Console(file=open("/dev/null", "w"), force_terminal=False)  # noqa: SIM115 - closed with it
    batch = batch_object(_job(total_requests=10), now=NOW, started_at=NOW - timedelta(seconds=10),
                         inflight=InflightReport(requests=10, tokens=100, budget=200))
    with JobProgress(total=10, console=console, interval_s=3600, label="batch_9") as bar:
        assert bar.eta_seconds is None
        bar.advance(2, 40)  # finished requests count at once
        assert bar.done == 2
        fetched = []
        bar.follow(lambda: fetched.append(1) or batch, interval_s=0.01)
        deadline = time.monotonic() + 10
        while not fetched and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fetched
        bar.show(batch)
        assert bar.eta_seconds == 10.0 and bar.done == 2  # the database may lag the runner's own count
        assert bar.line().startswith("batch_9 in_progress: 2/10 requests (20.0%), 10.0 tok/s")
        assert bar.line().endswith("ETA 0:00:10")
    console.file.close()


@pytest.mark.integration  # the tiny model in a worker thread, a SQLite database
def test_a_running_worker_reports_its_in_flight_tokens_before_any_request_finished(
        tmp_path: Path, sqlite_url: str, tiny_llama: Path) -> None:
    import threading

    from batchinfer.store.jobs import get_job
    from batchinfer.store.serialize import current_batch_object
    from workers.process import make_runner, run_job

    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path / "data", lease_seconds=1.5, shard_size=16)
    with (tmp_path / "in.jsonl").open("w") as out:
        for i in range(32):  # all run side by side and finish together: nothing finishes for seconds
            body = {"prompt": f"count {i}", "max_tokens": 480, "ignore_eos": True}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            out.write(orjson.dumps(line).decode() + "\n")
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        job = submit_job(session, settings=settings, path=tmp_path / "in.jsonl", model=str(tiny_llama),
                         owner="t")
    runner = make_runner(model=str(tiny_llama), settings=settings, device="cpu", max_num_seqs=32,
                         kv_cache_memory_bytes=32 << 20)
    stop = threading.Event()
    worker = threading.Thread(target=run_job, kwargs={"job_id": job.id, "runner": runner, "stop": stop})
    worker.start()
    seen = None
    try:
        deadline = time.monotonic() + 120
        while worker.is_alive() and time.monotonic() < deadline:
            with sessions() as session:
                batch = current_batch_object(session, get_job(session, job_id=job.id)).model_dump(mode="json")
            progress = batch["progress"]
            if batch["request_counts"]["completed"] == 0 and progress["generated_tokens"]:
                seen = progress
                break
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(timeout=60)
        runner.engine.close()
    assert seen is not None, "no in-flight tokens were reported before the first request finished"
    assert seen["tokens_per_second"] > 0 and seen["eta_seconds"] is not None
    assert 0 < seen["generated_tokens"] < 32 * 480
    assert seen["remaining_tokens"] == 32 * 480 - seen["generated_tokens"]  # budgets, nothing finished yet
