"""Scheduled pipelines with a controllable clock: cron slots, catch-up, races, outputs, signed webhooks."""

from __future__ import annotations

import http.server
import os
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from sqlalchemy import func, select

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.models import Job, ScheduleRun, WebhookDelivery
from batchinfer.store.schedules import ScheduleError, add_schedule
from tests.workers.helpers import read_lines, write_requests
from workers.cron import new_file_mode, tick, write_atomically
from workers.process import make_runner, run_job
from workers.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify

T0 = datetime(2026, 11, 1, 0, 0, tzinfo=UTC)  # 02:00 Europe/Rome is 01:00 UTC in November


def _settings(url: str, tmp_path: Path) -> Settings:
    upgrade(url)
    return Settings(database_url=url, data_dir=tmp_path)


def _add(settings: Settings, tmp_path: Path, *, catchup: str = "latest", **extra: object) -> None:
    with session_factory(settings.effective_database_url)() as session:
        add_schedule(session, name="nightly", cron="0 2 * * *", timezone="Europe/Rome", model="tiny",
                     input_template=str(tmp_path / "data" / "{date:%Y-%m-%d}" / "prompts.jsonl"),
                     output_template=str(tmp_path / "out" / "{date:%Y-%m-%d}.jsonl"),
                     errors_template=str(tmp_path / "out" / "{date:%Y-%m-%d}.errors.jsonl"),
                     catchup=catchup, now=T0, **extra)


def _inputs(tmp_path: Path, *days: str) -> None:
    for day in days:
        (tmp_path / "data" / day).mkdir(parents=True, exist_ok=True)
        write_requests(tmp_path / "data" / day / "prompts.jsonl", 3)


def _runs(settings: Settings) -> list[tuple[str, str, str | None]]:
    with session_factory(settings.effective_database_url)() as session:
        runs = session.scalars(select(ScheduleRun).order_by(ScheduleRun.slot_at)).all()
        return [(r.slot_at.strftime("%m-%d %H:%M"), str(r.status), r.error) for r in runs]


def test_slots_follow_cron_in_timezone_and_run_once(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path)
    _add(settings, tmp_path)
    _inputs(tmp_path, "2026-11-01")
    assert tick(settings=settings, now=T0 + timedelta(minutes=30)) == 0
    assert tick(settings=settings, now=T0 + timedelta(hours=1, seconds=30)) == 1
    assert tick(settings=settings, now=T0 + timedelta(hours=1, seconds=45)) == 0  # same slot again
    assert _runs(settings) == [("11-01 01:00", "submitted", None)]


@pytest.mark.parametrize(("catchup", "expected"), [
    ("latest", ["11-05 01:00"]),
    ("all", ["11-02 01:00", "11-03 01:00", "11-04 01:00", "11-05 01:00"]),
    ("none", []),
])
def test_catch_up_after_downtime(sqlite_url: str, tmp_path: Path, catchup: str, expected: list[str]) -> None:
    settings = _settings(sqlite_url, tmp_path)
    _add(settings, tmp_path, catchup=catchup)
    _inputs(tmp_path, "2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04", "2026-11-05")
    tick(settings=settings, now=T0 + timedelta(hours=1, seconds=5))  # the first night runs
    tick(settings=settings, now=T0 + timedelta(days=4, hours=3))  # back after three missed nights
    assert [slot for slot, _, _ in _runs(settings)][1:] == expected
    tick(settings=settings, now=T0 + timedelta(days=4, hours=4))
    assert len(_runs(settings)) == 1 + len(expected)  # nothing more until the next slot


def test_missing_input_records_a_failed_run_and_the_schedule_goes_on(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path)
    _add(settings, tmp_path)
    _inputs(tmp_path, "2026-11-02")
    tick(settings=settings, now=T0 + timedelta(hours=1, seconds=5))
    tick(settings=settings, now=T0 + timedelta(days=1, hours=1, seconds=5))
    runs = _runs(settings)
    assert runs[0][1] == "failed" and "input file not found" in runs[0][2] and "2026-11-01" in runs[0][2]
    assert runs[1][1] == "submitted"


def test_a_run_claimed_by_a_ticker_that_died_before_submitting_is_started_later(sqlite_url: str,
                                                                               tmp_path: Path) -> None:
    from batchinfer.store.schedules import claim_slot, get_schedule
    from workers.cron import STALE_PENDING_RUN

    settings = _settings(sqlite_url, tmp_path)
    _add(settings, tmp_path)
    _inputs(tmp_path, "2026-11-01")
    slot, claimed = T0 + timedelta(hours=1), T0 + timedelta(hours=1, seconds=2)
    with session_factory(settings.effective_database_url)() as session:  # the claim, then the crash
        assert claim_slot(session, schedule=get_schedule(session, name="nightly"), slot_at=slot,
                          now=claimed) is not None
    assert tick(settings=settings, now=claimed + timedelta(seconds=30)) == 0  # maybe still submitting
    assert _runs(settings) == [("11-01 01:00", "pending", None)]
    assert tick(settings=settings, now=claimed + STALE_PENDING_RUN + timedelta(seconds=1)) == 1
    assert _runs(settings) == [("11-01 01:00", "submitted", None)]
    assert tick(settings=settings, now=claimed + 2 * STALE_PENDING_RUN) == 0  # once
    with session_factory(settings.effective_database_url)() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 1


def _race(settings: Settings, now: datetime, threads: int = 4) -> None:
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def one() -> None:
        barrier.wait()
        try:
            tick(settings=settings, now=now)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors


@pytest.mark.parametrize("database", ["sqlite_url", pytest.param("pg_url", marks=pytest.mark.postgres)])
def test_racing_ticks_make_one_job(database: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url = request.getfixturevalue(database)
    settings = _settings(url, tmp_path)
    _add(settings, tmp_path)
    _inputs(tmp_path, "2026-11-01")
    _race(settings, T0 + timedelta(hours=1, seconds=5))
    with session_factory(url)() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 1
        assert session.scalar(select(func.count()).select_from(ScheduleRun)) == 1


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list[tuple[dict, bytes]] = []
    fail_first = 1

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((dict(self.headers), body))
        status = 500 if len(type(self).received) <= type(self).fail_first else 200
        self.send_response(status)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def test_outputs_written_and_signed_webhook_retried(
        sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    _Hook.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = _settings(sqlite_url, tmp_path)
        with session_factory(sqlite_url)() as session:
            add_schedule(session, name="nightly", cron="0 2 * * *", timezone="Europe/Rome",
                         model=str(tiny_llama),
                         input_template=str(tmp_path / "data" / "{date:%Y-%m-%d}" / "*.jsonl"),
                         output_template=str(tmp_path / "out" / "{date:%Y-%m-%d}.jsonl"),
                         errors_template=str(tmp_path / "out" / "{date:%Y-%m-%d}.errors.jsonl"),
                         params={"max_tokens": 3}, webhook_url=f"http://127.0.0.1:{server.server_port}/hook",
                         webhook_secret="s3cret", now=T0)
        day = tmp_path / "data" / "2026-11-01"
        day.mkdir(parents=True)
        (day / "part-1.jsonl").write_bytes(b"".join(  # no max_tokens: the schedule's default applies
            orjson.dumps({"custom_id": f"req-{i:04d}", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"messages": [{"role": "user", "content": f"question {i}"}],
                                   "ignore_eos": True}}) + b"\n" for i in range(3)))
        now = T0 + timedelta(hours=1, seconds=5)
        assert tick(settings=settings, now=now) == 1
        job_id = _runs_job(settings)
        run_job(job_id=job_id, runner=make_runner(model=str(tiny_llama), settings=settings, device="cpu",
                                                  kv_cache_memory_bytes=16 << 20))
        tick(settings=settings, now=now + timedelta(minutes=1))  # writes outputs, first webhook attempt fails
        out = read_lines(tmp_path / "out" / "2026-11-01.jsonl")
        assert [line["custom_id"] for line in out] == ["req-0000", "req-0001", "req-0002"]
        # max_tokens came from the schedule's default params
        assert all(line["response"]["body"]["usage"]["completion_tokens"] == 3 for line in out)
        assert (tmp_path / "out" / "2026-11-01.errors.jsonl").read_bytes() == b""
        assert not list((tmp_path / "out").glob(".*"))  # no temp files left behind
        assert len(_Hook.received) == 1
        tick(settings=settings, now=now + timedelta(minutes=1, seconds=10))  # backoff not over: no attempt
        assert len(_Hook.received) == 1
        tick(settings=settings, now=now + timedelta(minutes=2))  # retried and delivered
        assert len(_Hook.received) == 2
        headers, body = _Hook.received[1]
        assert verify("s3cret", headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
        assert not verify("wrong", headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
        payload = orjson.loads(body)
        assert payload["status"] == "completed" and payload["request_counts"]["completed"] == 3
        assert payload["output_path"].endswith("2026-11-01.jsonl")
        with session_factory(sqlite_url)() as session:
            delivery = session.scalars(select(WebhookDelivery)).one()
            assert delivery.attempts == 2 and delivery.delivered_at is not None
        tick(settings=settings, now=now + timedelta(hours=1))
        assert len(_Hook.received) == 2  # delivered once, never again
    finally:
        server.shutdown()


def _runs_job(settings: Settings) -> int:
    with session_factory(settings.effective_database_url)() as session:
        return session.scalars(select(ScheduleRun)).one().job_id


def test_output_files_appear_complete_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "out" / "results.jsonl"

    def broken():  # noqa: ANN202
        yield b'{"a": 1}\n'
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(target, broken())
    assert not target.exists() and not list(target.parent.iterdir())
    assert write_atomically(target, (b"%d\n" % i for i in range(1000))) == 1000
    assert target.read_bytes().count(b"\n") == 1000


def test_output_files_get_an_ordinary_files_mode_not_0600(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        assert new_file_mode() == 0o640
        write_atomically(tmp_path / "r.jsonl", [b"{}\n"])
        (tmp_path / "plain").write_bytes(b"")  # what any other new file gets
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "r.jsonl").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o640


def test_invalid_schedule_names_the_field(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path)
    with session_factory(settings.effective_database_url)() as session:
        with pytest.raises(ScheduleError, match="cron"):
            add_schedule(session, name="x", cron="every night", input_template="a", model="m")
        with pytest.raises(ScheduleError, match="timezone"):
            add_schedule(session, name="x", cron="0 2 * * *", timezone="Mars/Base", input_template="a",
                         model="m")
