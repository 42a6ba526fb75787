"""What a finished `batchinfer run` leaves behind (issue 29 item 11): no empty errors file (OpenAI makes
none when no request failed), no worker listed as live, result files with an ordinary file's mode."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.cli.helpers import cli, tiny_model_env
from tests.workers.helpers import read_lines, write_requests


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return tiny_model_env(monkeypatch, tmp_path, tiny_llama)


def test_a_clean_run_writes_no_errors_file_and_leaves_no_live_worker(env: Path) -> None:
    ids = write_requests(env / "in.jsonl", 3)
    previous = os.umask(0o022)
    try:
        code, out = cli("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"))
    finally:
        os.umask(previous)
    assert code == 0, out
    assert [line["custom_id"] for line in read_lines(env / "out.jsonl")] == ids
    assert not (env / "out.errors.jsonl").exists() and "errors:" not in out
    assert stat.S_IMODE((env / "out.jsonl").stat().st_mode) == 0o644
    code, out = cli("workers", "--json")
    assert code == 0 and out.strip() == ""  # the run's engine is gone: not a live worker any more
    code, out = cli("workers", "--all", "--json")
    assert code == 0 and '"live":false' in out


def test_a_run_with_failures_writes_them_and_empties_a_stale_errors_file(env: Path) -> None:
    (env / "out.errors.jsonl").write_text('{"stale": true}\n')
    write_requests(env / "ok.jsonl", 2)
    code, out = cli("run", str(env / "ok.jsonl"), "-o", str(env / "out.jsonl"))
    assert code == 0 and (env / "out.errors.jsonl").read_bytes() == b""  # not an earlier run's errors
    write_requests(env / "bad.jsonl", 2, extra_lines=[b"not json"])
    code, out = cli("run", str(env / "bad.jsonl"), "-o", str(env / "out.jsonl"))
    assert code == 3 and "errors:" in out
    assert [line["error"]["code"] for line in read_lines(env / "out.errors.jsonl")] == ["invalid_json"]
