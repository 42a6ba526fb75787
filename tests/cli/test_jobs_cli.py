"""The job commands in local mode (SQLite, in-process worker): run, submit, status, list, results, cancel."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.cli.helpers import cli, tiny_model_env
from tests.workers.helpers import read_lines, write_requests


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_SHARD_SIZE", "5")
    return tiny_model_env(monkeypatch, tmp_path, tiny_llama)


def test_run_end_to_end_writes_results_in_order(env: Path) -> None:
    ids = write_requests(env / "in.jsonl", 12, extra_lines=[b"not json"])
    code, out = cli("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--show", "2")
    assert code == 3, out  # completed, one line failed
    assert [line["custom_id"] for line in read_lines(env / "out.jsonl")] == ids
    errors = read_lines(env / "out.errors.jsonl")
    assert len(errors) == 1 and "line 13" in errors[0]["error"]["message"]
    assert "completed" in out and "--- req-0000" in out


def test_submit_status_results_and_idempotency(env: Path) -> None:
    write_requests(env / "in.jsonl", 6)
    code, out = cli("submit", str(env / "in.jsonl"), "--json", "--idempotency-key", "nightly-1",
                     "--metadata", "team=search")
    assert code == 0, out
    batch = orjson.loads(out)
    assert batch["status"] == "in_progress" and batch["metadata"] == {"team": "search"}
    code, again = cli("submit", str(env / "in.jsonl"), "--json", "--idempotency-key", "nightly-1")
    assert orjson.loads(again)["id"] == batch["id"]  # a retried submit returns the same job

    code, listing = cli("list", "--json")
    assert [orjson.loads(line)["id"] for line in listing.splitlines()] == [batch["id"]]
    code, status = cli("status", batch["id"])
    assert code == 0 and "in_progress" in status and "0/6" in status

    code, out = cli("cancel", batch["id"], "--json")
    assert orjson.loads(out)["status"] in ("cancelling", "cancelled")
    code, out = cli("results", batch["id"], "-o", str(env / "r.jsonl"), "--errors", str(env / "e.jsonl"))
    assert code == 0
    assert read_lines(env / "r.jsonl") == []
    assert {line["error"]["code"] for line in read_lines(env / "e.jsonl")} == {"batch_cancelled"}


def test_bad_file_fails_with_clear_message_and_exit_code(env: Path) -> None:
    (env / "bad.jsonl").write_bytes(b"\x00\x01\x02 binary garbage\n")
    code, out = cli("submit", str(env / "bad.jsonl"))
    assert code == 4
    assert "failed" in out and "line 1" in out


def test_unknown_batch_is_an_error(env: Path) -> None:
    code, out = cli("status", "batch_999")
    assert code == 1 and "not found" in out
    code, out = cli("status", "nonsense")
    assert code == 1 and "batch id" in out
