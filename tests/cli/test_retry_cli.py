"""`batchinfer retry` (issue 31): a cancelled batch's lines run again as a child batch naming its parent;
invalid lines are named and left out; nothing of a kind to retry is one line and exit 1."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from tests.cli.helpers import cli
from tests.workers.helpers import write_requests


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def test_retry_a_cancelled_batch(env: Path) -> None:
    write_requests(env / "in.jsonl", 4, extra_lines=[b"not json"])
    code, out = cli("submit", str(env / "in.jsonl"), "-q")
    assert code == 0, out
    parent = out.strip()
    code, out = cli("retry", parent)
    assert code == 1 and "retry it once it has ended" in out
    assert cli("cancel", parent)[0] == 0

    code, out = cli("retry", parent)
    assert code == 0, out
    assert re.search(rf"batch_\d+: retrying 4 line\(s\) of {parent}; left out \(invalid input, "
                     r"--include-invalid retries them\): line 5 \(invalid_json\)", out), out
    child = re.findall(r"batch_\d+", out)[0]
    code, out = cli("status", child, "--json")
    batch = orjson.loads(out)
    assert batch["metadata"] == {"retry_of": parent} and batch["request_counts"]["total"] == 4

    code, out = cli("retry", parent, "--only", "expired")
    assert code == 1 and f"{parent} has no expired lines to retry" in out
    code, out = cli("retry", parent, "--only", "lost")
    assert code == 1 and "--only: 'lost' is not a kind of line to retry" in out
