"""`batchinfer purge` (issue 15): finished batches past the retention setting are deleted, others stay."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from tests.workers.helpers import write_requests


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_purge_deletes_finished_batches_past_retention(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_FINISHED_JOB_RETENTION_SECONDS", "0.5")
    write_requests(tmp_path / "in.jsonl", 3)
    ids = []
    for _ in range(2):
        code, out = _cli("submit", str(tmp_path / "in.jsonl"), "--model", "m", "--json")
        assert code == 0, out
        ids.append(orjson.loads(out)["id"])
    assert _cli("cancel", ids[0])[0] == 0
    time.sleep(0.6)
    code, out = _cli("purge", "--json")
    assert code == 0 and orjson.loads(out) == {"files": [], "jobs": [ids[0]]}
    assert _cli("status", ids[0])[0] != 0  # gone
    assert _cli("status", ids[1])[0] == 0  # still running: kept
    assert "purged 0 file(s) and 0 batch(es)" in _cli("purge")[1]
