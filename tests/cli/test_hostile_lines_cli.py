"""`batchinfer submit` as an attacker would use it (issue 28 item 1): a line nesting 300 levels (orjson
reads it, and cannot write it back) is that line's error; the batch is created with the other lines."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", "no-worker-serves-this")
    return tmp_path


def test_submit_with_a_300_level_line_errors_that_line_and_creates_the_batch(env: Path) -> None:
    deep: object = 1
    for _ in range(300):
        deep = [deep]
    lines = [{"prompt": "fine"}, {"prompt": "deep", "anything": deep}, {"prompt": "also fine"}]
    (env / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["submit", str(env / "in.jsonl"), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    batch = orjson.loads(result.stdout)
    assert batch["status"] in ("validating", "in_progress") and batch["request_counts"]["total"] == 3
    [error] = batch["errors"]["data"]
    assert error["line"] == 2 and error["param"] == "anything"
    assert error["message"] == ("line 2: anything: nests more than 254 levels deep (the JSON nesting limit "
                                "of a stored request); flatten it")
