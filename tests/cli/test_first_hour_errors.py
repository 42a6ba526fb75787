"""A newcomer's mistakes are one line and a documented exit code, never a traceback (issue 29, item 2).

Each case is typed through the real CLI: a hub id that is not here, settings vLLM users write (fp16,
gpu), a CUDA device with a CPU torch, a PostgreSQL never migrated / down / missing, a broker down at
submit. A `run` whose engine cannot start fails its job instead of leaving it in_progress.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa

from tests.cli.helpers import invoke
from tests.workers.helpers import write_requests

HUB_ID = "meta-llama/Meta-Llama-3-8B-Instruct"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEVICE", "cpu")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_MEMORY_BYTES", str(16 << 20))
    write_requests(tmp_path / "in.jsonl", 2)
    return tmp_path


def _one_line(result, *needles: str) -> str:
    """The error line, after checking it is the only stderr line and names every needle."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(needle in errors[0] for needle in needles), errors[0]
    return errors[0]


def _jobs(env: Path) -> list[dict]:
    result = invoke("list", "--json")
    assert result.exit_code == 0, result.output
    return [orjson.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.parametrize(("variable", "value", "needles"), [
    ("BATCHINFER_DTYPE", "fp16", ("dtype", "'fp16'", "float16", "bfloat16")),
    ("BATCHINFER_DEVICE", "gpu", ("device", "'gpu'", "cuda:N")),
])
def test_settings_vllm_users_type_are_refused_when_read(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                        variable: str, value: str, needles: tuple[str, ...]):
    monkeypatch.setenv(variable, value)
    shown = invoke("config", "show")  # refused as `run` would refuse them, not accepted and shown
    assert shown.exit_code == 1
    _one_line(shown, variable, *needles)
    ran = invoke("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"))
    assert ran.exit_code == 1
    _one_line(ran, variable)


def test_vllm_dtype_spellings_are_accepted(env: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BATCHINFER_DTYPE", "half")
    shown = invoke("config", "show", "--json")
    assert shown.exit_code == 0, shown.output
    assert orjson.loads(shown.stdout)["dtype"] == "float16"


@pytest.mark.parametrize(("args", "needles"), [
    (("--model", HUB_ID), (HUB_ID, "not in the local Hugging Face cache", "alias")),
    (("--model", "no-such-model"), ("no-such-model", "not found")),
    (("--dtype", "fp16"), ("dtype", "'fp16'")),
    (("--device", "gpu"), ("device", "'gpu'")),
])
def test_run_refuses_a_model_or_engine_flag_before_creating_a_job(env: Path, args: tuple[str, ...],
                                                                  needles: tuple[str, ...]):
    result = invoke("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), *args)
    assert result.exit_code == 1
    _one_line(result, *needles)
    assert _jobs(env) == []  # nothing left in_progress for 24 h


def test_run_on_cuda_with_a_cpu_torch_is_one_line(env: Path):
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    result = invoke("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--device", "cuda")
    assert result.exit_code == 1
    _one_line(result, "'cuda'", "CPU build", "--device cpu")
    assert _jobs(env) == []


def test_a_run_whose_engine_cannot_start_fails_its_job(env: Path, tiny_llama: Path):
    broken = env / "broken-model"
    shutil.copytree(tiny_llama, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"\0" * 64)  # config and tokenizer fine, weights unreadable
    result = invoke("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--model", str(broken))
    assert result.exit_code == 4  # the job failed
    _one_line(result, "batch_", "failed", "the engine could not start")
    [job] = _jobs(env)
    assert job["status"] == "failed" and "could not start" in job["errors"]["data"][0]["message"]


def test_list_on_a_postgres_never_migrated_says_db_upgrade(env: Path, pg_url: str,
                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", pg_url)
    result = invoke("list")
    assert result.exit_code == 1
    _one_line(result, "no batchinfer tables", "batchinfer db upgrade")
    upgraded = invoke("db", "upgrade")
    assert upgraded.exit_code == 0, upgraded.output
    assert invoke("list").exit_code == 0


def test_a_postgres_down_or_missing_is_one_line(env: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch):
    missing = sa.make_url(pg_url).set(database="bi_no_such_database").render_as_string(hide_password=False)
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", missing)
    result = invoke("list")
    assert result.exit_code == 1
    _one_line(result, "bi_no_such_database", "does not exist", "createdb")
    down = sa.make_url(pg_url).set(host="127.0.0.1", port=1).render_as_string(hide_password=False)
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", down)
    result = invoke("status", "batch_1")
    assert result.exit_code == 1
    _one_line(result, "unreachable", "start it")


def test_a_sqlite_file_that_fails_is_not_called_unreachable(env: Path, monkeypatch: pytest.MonkeyPatch):
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from batchinfer.cli.failures import describe_failure
    from batchinfer.config import get_settings

    monkeypatch.setenv("BATCHINFER_DATABASE_URL", f"sqlite:///{env / 'b.db'}")
    get_settings.cache_clear()
    locked = describe_failure(OperationalError("INSERT ...", {}, sqlite3.OperationalError(
        "database is locked")))
    assert "is locked by another process" in locked and "start it" not in locked
    unopened = describe_failure(OperationalError("SELECT 1", {}, sqlite3.OperationalError(
        "unable to open database file")))
    assert "cannot be used (unable to open database file); check that its directory" in unopened
    get_settings.cache_clear()


def test_submit_with_the_broker_down_is_refused_in_one_line(env: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BATCHINFER_BROKER_URL", "redis://127.0.0.1:1/0")
    result = invoke("submit", str(env / "in.jsonl"))
    assert result.exit_code == 1
    _one_line(result, "broker redis://127.0.0.1:1/0 is unreachable", "BATCHINFER_BROKER_URL")
    monkeypatch.delenv("BATCHINFER_BROKER_URL")
    assert _jobs(env) == []  # refused before the job exists: nothing waits on a broker nobody reaches


def test_json_mode_errors_are_one_json_object(env: Path):
    result = invoke("run", str(env / "in.jsonl"), "-o", str(env / "out.jsonl"), "--model", HUB_ID, "--json")
    assert result.exit_code == 1 and result.stdout == ""
    error = orjson.loads(result.stderr)
    assert error["exit_code"] == 1 and HUB_ID in error["error"]["message"]
