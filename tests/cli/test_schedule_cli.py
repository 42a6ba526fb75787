"""`batchinfer schedule` commands against the embedded SQLite database."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from tests.workers.helpers import write_requests


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_schedule_lifecycle(env: Path) -> None:
    template = str(env / "in" / "{date:%Y-%m-%d}.jsonl")
    code, out = _cli("schedule", "add", "nightly", "--cron", "30 2 * * *", "--tz", "Europe/Rome",
                     "--input", template, "--output", str(env / "out" / "{date:%Y-%m-%d}.jsonl"),
                     "--param", "max_tokens=8", "--param", "temperature=0")
    assert code == 0, out
    assert "next run" in out and " 02:30 Europe/Rome" in out  # in the schedule's timezone, not UTC
    code, out = _cli("schedule", "add", "nightly", "--cron", "30 2 * * *", "--input", template)
    assert code == 1 and "exists already" in out
    code, out = _cli("schedule", "list", "--json")
    listed = orjson.loads(out)
    assert listed["name"] == "nightly" and listed["enabled"]
    assert listed["next_run"].endswith(("T02:30:00+01:00", "T02:30:00+02:00"))  # Rome's offset
    assert listed["params"] == {"max_tokens": 8, "temperature": 0}
    assert _cli("schedule", "pause", "nightly")[0] == 0
    assert orjson.loads(_cli("schedule", "show", "nightly", "--json")[1])["enabled"] is False
    assert _cli("schedule", "resume", "nightly")[0] == 0

    code, out = _cli("schedule", "run-now", "nightly")  # today's input does not exist yet
    assert code == 1 and "input file not found" in out
    from datetime import UTC, datetime
    from zoneinfo import ZoneInfo

    today = datetime.now(UTC).astimezone(ZoneInfo("Europe/Rome")).strftime("%Y-%m-%d")
    (env / "in").mkdir()
    write_requests(env / "in" / f"{today}.jsonl", 3)
    code, out = _cli("schedule", "run-now", "nightly")
    assert code == 0 and "started batch_" in out
    shown = orjson.loads(_cli("schedule", "show", "nightly", "--json")[1])
    assert [run["status"] for run in shown["runs"]][:1] == ["submitted"]
    assert _cli("schedule", "remove", "nightly")[0] == 0
    assert _cli("schedule", "show", "nightly")[0] == 1


def test_bad_definitions_name_the_field(env: Path) -> None:
    code, out = _cli("schedule", "add", "x", "--cron", "nightly", "--input", "a.jsonl")
    assert code == 1 and "cron" in out
    code, out = _cli("schedule", "add", "x", "--cron", "0 1 * * *", "--input", "a.jsonl",
                     "--param", "temperature=-1")
    assert code == 2 and "temperature" in out
