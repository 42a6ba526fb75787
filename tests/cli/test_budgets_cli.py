"""`batchinfer submit/run --max-total-tokens` (issue 32): the budget is stored and shown, a bad one refused,
and `run` ends the lines past it with budget_exceeded while keeping the finished ones."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.cli.helpers import cli, tiny_model_env
from tests.workers.helpers import read_lines, write_requests


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return tiny_model_env(monkeypatch, tmp_path, tiny_llama)


def test_submit_stores_the_budget_and_refuses_a_bad_one(env: Path) -> None:
    write_requests(env / "in.jsonl", 3)
    code, out = cli("submit", str(env / "in.jsonl"), "--max-total-tokens", "0")
    assert code == 2 and "--max-total-tokens" in out
    code, out = cli("submit", str(env / "in.jsonl"), "--max-total-tokens", "1000", "--json")
    assert code == 0, out
    assert orjson.loads(out)["max_total_tokens"] == 1000


def test_run_ends_the_lines_past_the_budget_and_keeps_the_finished_ones(env: Path) -> None:
    write_requests(env / "in.jsonl", 12)  # about 30 prompt tokens and 6 to 8 completion tokens a line
    code, out = cli("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--max-total-tokens", "120",
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
