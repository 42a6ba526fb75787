"""One schedule run's trouble stays its own: an output that cannot be written, an input glob that matches
directories, or an input that cannot be read fails that run (error recorded, webhook status `failed`),
never leaves it `pending`, and never keeps other runs or their webhooks waiting."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select

from batchinfer.config import Settings
from batchinfer.store.db import get_engine, session_factory, upgrade
from batchinfer.store.models import Job, ScheduleRun, WebhookDelivery
from batchinfer.store.schedules import add_schedule
from batchinfer.store.shards import claim_shard, complete_shard, list_shards, pending_requests, write_results
from tests.store.helpers import fake_results
from tests.workers.helpers import read_lines, write_requests
from workers.cron import tick

T0 = datetime(2026, 11, 1, 0, 0, tzinfo=UTC)
SLOT = T0 + timedelta(hours=2, seconds=5)  # just after the 02:00 UTC slot


class _Receiver(http.server.BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        type(self).received.append(orjson.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def hook_url() -> Iterator[str]:
    """A webhook receiver on a free port; what it received is _Receiver.received."""
    _Receiver.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook"
    finally:
        server.shutdown()


@pytest.fixture(params=["sqlite_url", pytest.param("pg_url", marks=pytest.mark.postgres)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    url = request.getfixturevalue(request.param)
    upgrade(url)
    yield Settings(database_url=url, data_dir=tmp_path / "data")
    get_engine(url).dispose()


def _add(settings: Settings, name: str, *, input_template: str, output_template: str | None = None,
         webhook_url: str | None = None, model: str = "fake") -> None:
    with session_factory(settings.effective_database_url)() as session:
        add_schedule(session, name=name, cron="0 2 * * *", model=model, input_template=input_template,
                     output_template=output_template, webhook_url=webhook_url, now=T0)


def _runs(settings: Settings) -> dict[str, ScheduleRun]:
    from batchinfer.store.models import Schedule

    with session_factory(settings.effective_database_url)() as session:
        rows = session.execute(select(Schedule.name, ScheduleRun).join(ScheduleRun)).all()
        return {name: run for name, run in rows}


def _finish_every_job(settings: Settings) -> None:
    """Answer every pending request the way a worker would (fake but real results, through the store)."""
    with session_factory(settings.effective_database_url)() as session:
        for job_id in session.scalars(select(Job.id)).all():
            for shard in list_shards(session, job_id=job_id):
                lease = claim_shard(session, worker_id="w", shard_id=shard.id, lease_seconds=60)
                results = fake_results(pending_requests(session, shard_id=shard.id))
                write_results(session, shard_id=shard.id, lease_token=lease.lease_token, results=results)
                complete_shard(session, shard_id=shard.id, lease_token=lease.lease_token)


def test_an_unwritable_output_fails_its_run_alone(settings: Settings, tmp_path: Path, hook_url: str):
    write_requests(tmp_path / "in.jsonl", 3)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output directory should be")
    # "a-broken" sorts first: before the fix its failure stopped every tick before "b-fine" and the webhooks
    _add(settings, "a-broken", input_template=str(tmp_path / "in.jsonl"),
         output_template=str(blocker / "out.jsonl"), webhook_url=hook_url)
    _add(settings, "b-fine", input_template=str(tmp_path / "in.jsonl"),
         output_template=str(tmp_path / "out" / "fine.jsonl"), webhook_url=hook_url)
    assert tick(settings=settings, now=SLOT) == 2
    _finish_every_job(settings)
    tick(settings=settings, now=SLOT + timedelta(minutes=1))

    runs = _runs(settings)
    broken, fine = runs["a-broken"], runs["b-fine"]
    assert broken.status == "failed" and broken.finished_at is not None and broken.output_path is None
    assert str(blocker / "out.jsonl") in broken.error and "could not be written" in broken.error
    assert f"batchinfer results batch_{broken.job_id}" in broken.error  # where the results still are
    assert fine.status == "completed" and fine.error is None
    assert [line["custom_id"] for line in read_lines(tmp_path / "out" / "fine.jsonl")] == \
        ["req-0000", "req-0001", "req-0002"]
    by_schedule = {payload["schedule"]: payload for payload in _Receiver.received}
    assert by_schedule["a-broken"]["status"] == "failed" and by_schedule["a-broken"]["job_status"] == \
        "completed"
    assert "could not be written" in by_schedule["a-broken"]["error"]
    assert by_schedule["b-fine"]["status"] == "completed"

    tick(settings=settings, now=SLOT + timedelta(minutes=2))  # nothing is redone or sent twice
    assert len(_Receiver.received) == 2
    assert {name: run.status for name, run in _runs(settings).items()} == \
        {"a-broken": "failed", "b-fine": "completed"}


def test_a_glob_matching_only_directories_fails_the_run_with_a_message(settings: Settings, tmp_path: Path,
                                                                       hook_url: str):
    (tmp_path / "in" / "2026-11-01.jsonl").mkdir(parents=True)  # a directory named like an input
    _add(settings, "dirs", input_template=str(tmp_path / "in" / "*.jsonl"), webhook_url=hook_url)
    tick(settings=settings, now=SLOT)
    run = _runs(settings)["dirs"]
    assert run.status == "failed" and run.job_id is None and run.finished_at is not None
    assert "matched only directories" in run.error and "2026-11-01.jsonl" in run.error
    tick(settings=settings, now=SLOT + timedelta(minutes=1))
    assert [payload["status"] for payload in _Receiver.received] == ["failed"]


def test_directories_beside_input_files_are_skipped(settings: Settings, tmp_path: Path):
    (tmp_path / "in" / "b-dir.jsonl").mkdir(parents=True)
    write_requests(tmp_path / "in" / "a.jsonl", 2)
    write_requests(tmp_path / "in" / "c.jsonl", 1)
    _add(settings, "mixed", input_template=str(tmp_path / "in" / "*.jsonl"))
    tick(settings=settings, now=SLOT)
    run = _runs(settings)["mixed"]
    assert run.status == "submitted", run.error
    assert run.input_path == f"{tmp_path / 'in' / 'a.jsonl'},{tmp_path / 'in' / 'c.jsonl'}"
    with session_factory(settings.effective_database_url)() as session:
        assert session.get(Job, run.job_id).total_requests == 3


def test_a_refused_submit_fails_its_run_and_the_others_start(settings: Settings, tmp_path: Path):
    write_requests(tmp_path / "ok.jsonl", 1)
    _add(settings, "a-no-model", input_template=str(tmp_path / "ok.jsonl"), model="")  # submit refuses it
    _add(settings, "b-ok", input_template=str(tmp_path / "ok.jsonl"))
    assert tick(settings=settings, now=SLOT) == 2
    runs = _runs(settings)
    assert runs["a-no-model"].status == "failed" and "model must not be empty" in runs["a-no-model"].error
    assert runs["b-ok"].status == "submitted"
    with session_factory(settings.effective_database_url)() as session:
        assert session.scalars(select(WebhookDelivery)).all() == []  # no webhook_url: nothing queued
