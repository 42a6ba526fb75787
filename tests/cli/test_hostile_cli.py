"""The local CLI against values and jobs it used to trip on: jobs a schedule started (other owner), ids
beyond any column, a completion_window beyond the maximum, a model no live worker serves."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from batchinfer.config import get_settings
from batchinfer.store.db import session_factory
from batchinfer.store.jobs import expire_jobs
from batchinfer.store.models import utcnow
from batchinfer.store.schedules import add_schedule
from batchinfer.store.workers import WORKER_LIVE_S, register_worker
from tests.workers.helpers import write_requests
from workers.cron import tick


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def _sessions():
    return session_factory(get_settings().effective_database_url)


def _scheduled_batch(env: Path) -> str:
    """Tick the schedules once past their first slot; the id of the one batch that started."""
    assert tick(settings=get_settings(), now=utcnow() + timedelta(minutes=2)) == 1
    code, out = _cli("list", "--json")
    assert code == 0, out
    batches = [orjson.loads(line) for line in out.splitlines()]
    assert len(batches) == 1, out  # the scheduled job is the local CLI's
    assert batches[0]["metadata"]["schedule"]
    return batches[0]["id"]


@pytest.mark.parametrize("made_by", ["cli", "store-without-owner"])
def test_jobs_a_schedule_started_are_visible_and_controllable(env: Path, made_by: str) -> None:
    write_requests(env / "in.jsonl", 4)
    if made_by == "cli":
        code, out = _cli("schedule", "add", "every-minute", "--cron", "* * * * *", "--input",
                         str(env / "in.jsonl"))
        assert code == 0, out
    else:  # a schedule stored before schedules had owners (owner ""): its jobs are still the CLI's
        _cli("list")  # migrates the embedded database
        with _sessions()() as session:
            add_schedule(session, name="legacy", cron="* * * * *", model="m", owner="",
                         input_template=str(env / "in.jsonl"))
    batch_id = _scheduled_batch(env)

    code, out = _cli("status", batch_id)
    assert code == 0 and batch_id in out and "0/4 done" in out, out
    code, out = _cli("cancel", batch_id, "--json")
    assert code == 0 and orjson.loads(out)["status"] == "cancelled", out
    code, out = _cli("results", batch_id, "-o", str(env / "r.jsonl"), "--errors", str(env / "e.jsonl"))
    assert code == 0, out
    errors = [orjson.loads(line) for line in (env / "e.jsonl").read_bytes().splitlines()]
    assert [line["error"]["code"] for line in errors] == ["batch_cancelled"] * 4


@pytest.mark.parametrize("batch_id", ["batch_2147483648", "2147483648", "batch_999999999999999999"])
def test_an_id_beyond_any_column_is_not_found(env: Path, batch_id: str) -> None:
    for command in ("status", "cancel", "results"):
        code, out = _cli(command, batch_id)
        assert code == 1 and "not found" in out and "Traceback" not in out, (command, out)
    code, out = _cli("list", "--after", batch_id)
    assert code == 0, out


@pytest.mark.parametrize("window", ["99999999d", "31d"])
def test_a_window_beyond_the_maximum_is_one_line_and_exit_1(env: Path, window: str) -> None:
    write_requests(env / "in.jsonl", 1)
    code, out = _cli("submit", str(env / "in.jsonl"), "--completion-window", window)
    assert code == 1, out
    assert out.strip().count("\n") == 0 and out.startswith("error: --completion-window"), out
    assert "longer than the maximum of 30d" in out
    assert _cli("list", "--json")[1] == ""  # nothing was submitted


def test_a_batch_no_live_worker_serves_says_so_and_expires(env: Path) -> None:
    write_requests(env / "in.jsonl", 3)
    code, out = _cli("submit", str(env / "in.jsonl"), "--model", "nobody-serves-this", "--json",
                     "--completion-window", "1h")
    batch = orjson.loads(out)
    note = batch["progress"]["note"]
    assert "no live worker serves model 'nobody-serves-this'" in note and "workers serve: none" in note
    with _sessions()() as session:
        register_worker(session, worker_id="w-live", model="other-model")
        register_worker(session, worker_id="w-gone", model="gone-model",
                        now=utcnow() - timedelta(seconds=2 * WORKER_LIVE_S))
    code, out = _cli("status", batch["id"])
    assert code == 0 and "note: no live worker serves model 'nobody-serves-this'" in out, out
    assert "workers serve: other-model." in out and "gone-model" not in out
    with _sessions()() as session:
        register_worker(session, worker_id="w-right", model="nobody-serves-this")
    code, out = _cli("status", batch["id"], "--json")
    assert orjson.loads(out)["progress"]["note"] is None  # a live worker serves it now

    with _sessions()() as session:
        assert expire_jobs(session, now=utcnow() + timedelta(hours=1, seconds=1)) == [int(batch["id"][6:])]
    code, out = _cli("status", batch["id"], "--json")
    expired = orjson.loads(out)
    assert expired["status"] == "expired" and expired["progress"]["note"] is None
    code, out = _cli("results", batch["id"], "-o", str(env / "r.jsonl"), "--errors", str(env / "e.jsonl"))
    errors = [orjson.loads(line) for line in (env / "e.jsonl").read_bytes().splitlines()]
    assert [line["error"]["code"] for line in errors] == ["batch_expired"] * 3
