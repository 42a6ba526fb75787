"""`batchinfer submit/run --max-total-tokens` (issue 32): the budget is stored and shown, a bad one refused,
and `run` ends the lines past it with budget_exceeded while keeping the finished ones."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from tests.workers.helpers import read_lines, write_requests


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", str(tiny_llama))
    monkeypatch.setenv("BATCHINFER_DEVICE", "cpu")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_MEMORY_BYTES", str(16 << 20))
    return tmp_path


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_submit_stores_the_budget_and_refuses_a_bad_one(env: Path) -> None:
    write_requests(env / "in.jsonl", 3)
    code, out = _cli("submit", str(env / "in.jsonl"), "--max-total-tokens", "0")
    assert code == 2 and "--max-total-tokens" in out
    code, out = _cli("submit", str(env / "in.jsonl"), "--max-total-tokens", "1000", "--json")
    assert code == 0, out
    assert orjson.loads(out)["max_total_tokens"] == 1000


def test_run_ends_the_lines_past_the_budget_and_keeps_the_finished_ones(env: Path) -> None:
    write_requests(env / "in.jsonl", 12)  # about 30 prompt tokens and 6 to 8 completion tokens a line
    code, out = _cli("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--max-total-tokens", "120",
                     "--json")
    batch = orjson.loads(out.strip().splitlines()[-1])
    assert batch["status"] == "completed", out
    assert batch["usage"]["total_tokens"] <= 120
    done, failed = batch["request_counts"]["completed"], batch["request_counts"]["failed"]
    assert done >= 1 and failed >= 1 and done + failed == 12
    assert len(read_lines(env / "out.jsonl")) == done
    errors = read_lines(env / "out.errors.jsonl")
    assert {line["error"]["code"] for line in errors} == {"budget_exceeded"} and len(errors) == failed
    assert code == 3  # some lines failed, as for any other line error
