"""The CLI as shell users expect it (issue 18): `--json` everywhere with JSON errors and the same exit
codes, one-line errors for a missing file and for bad settings, fresh data dirs created by every command,
`submit --wait` naming its batch first, partial `results` said so, no temp file left by a failed export."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner, Result

from batchinfer.cli import main
from batchinfer.config import get_settings
from tests.workers.helpers import write_requests


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data dir that does not exist yet (every command must create it)."""
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "fresh" / "data"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", "no-worker-serves-this")
    return tmp_path


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _json_error(result: Result) -> dict:
    """The one JSON error object a --json command printed on stderr (and nothing on stdout)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    error = orjson.loads(lines[0])
    assert error["exit_code"] == result.exit_code and error["error"]["message"]
    return error


def test_missing_input_file_is_one_line_and_exit_1_with_or_without_json(env: Path) -> None:
    for command in (["submit"], ["run", "-o", str(env / "out.jsonl")]):
        plain = _cli(*command, str(env / "absent.jsonl"))
        assert plain.exit_code == 1 and plain.stderr == f"error: {env / 'absent.jsonl'}: no such file\n"
        as_json = _cli(*command, str(env / "absent.jsonl"), "--json")
        assert as_json.exit_code == 1 and as_json.stdout == ""
        assert "no such file" in _json_error(as_json)["error"]["message"]
    assert _cli("submit", str(env)).stderr.endswith("is a directory, not a JSONL file\n")


def test_usage_errors_are_json_under_json_with_exit_2(env: Path) -> None:
    plain = _cli("status", "--bogus")
    assert plain.exit_code == 2 and "No such option" in plain.stderr
    as_json = _cli("status", "--bogus", "--json")
    assert as_json.exit_code == 2
    error = _json_error(as_json)["error"]
    assert error["type"] == "usage_error" and "No such option" in error["message"] and as_json.stdout == ""
    missing = _cli("apikey", "create", "--json")  # --name is required
    assert missing.exit_code == 2 and "--name" in _json_error(missing)["error"]["message"]


def test_unknown_batch_and_timeout_are_json_errors(env: Path) -> None:
    for command in ("status", "cancel", "results"):
        result = _cli(command, "batch_999", "--json")
        assert result.exit_code == 1 and "not found" in _json_error(result)["error"]["message"]
    write_requests(env / "in.jsonl", 2)
    waited = _cli("submit", str(env / "in.jsonl"), "--wait", "--timeout", "0.2", "--json")
    assert waited.exit_code == 7
    assert _json_error(waited)["error"]["type"] == "timeout"
    first = orjson.loads(waited.stdout.splitlines()[0])  # the batch id came first, before the wait
    assert first["id"].startswith("batch_") and first["status"] == "in_progress"


def test_submit_wait_prints_the_batch_id_first(env: Path) -> None:
    write_requests(env / "in.jsonl", 3)
    result = _cli("submit", str(env / "in.jsonl"), "--wait", "--timeout", "0.2")
    assert result.exit_code == 7
    assert result.stdout.splitlines()[0].startswith("batch_1  in_progress")
    assert "timed out waiting for batch_1" in result.stderr


def test_fresh_data_dir_is_created_and_migrated_by_apikey_and_api(env: Path, monkeypatch) -> None:
    import uvicorn

    created = _cli("apikey", "create", "--name", "ci", "--json")
    assert created.exit_code == 0, created.output
    key = orjson.loads(created.stdout)
    assert key["key"].startswith("bi-") and key["owner"] == "ci" and key["revoked_at"] is None
    listed = _cli("apikey", "list", "--json")
    assert [orjson.loads(line)["id"] for line in listed.stdout.splitlines()] == [key["id"]]
    assert key["key"] not in listed.stdout
    revoked = _cli("apikey", "revoke", str(key["id"]), "--json")
    assert orjson.loads(revoked.stdout)["revoked_at"] is not None

    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(env / "another" / "fresh"))
    get_settings.cache_clear()
    started: list[uvicorn.Config] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, **kw: started.append(server.config))
    served = _cli("api", "--port", "8123", "--json")
    assert served.exit_code == 0, served.output
    line = orjson.loads(served.stdout)
    assert line["event"] == "api_started" and line["url"] == "http://127.0.0.1:8123"
    assert [config.port for config in started] == [8123]
    assert (env / "another" / "fresh" / "batchinfer.db").is_file()


def test_json_on_db_schedule_and_start_lines(env: Path) -> None:
    upgraded = _cli("db", "upgrade", "--json")
    assert orjson.loads(upgraded.stdout)["revision"] == "head"
    (env / "in.jsonl").write_bytes(b'{"prompt": "x"}\n')
    added = _cli("schedule", "add", "nightly", "--cron", "0 2 * * *", "--input", str(env / "in.jsonl"),
                 "--json")
    assert added.exit_code == 0, added.output
    assert orjson.loads(added.stdout)["name"] == "nightly"
    assert orjson.loads(_cli("schedule", "pause", "nightly", "--json").stdout)["enabled"] is False
    assert orjson.loads(_cli("schedule", "resume", "nightly", "--json").stdout)["enabled"] is True
    ran = _cli("schedule", "run-now", "nightly", "--json")
    assert ran.exit_code == 0, ran.output
    assert orjson.loads(ran.stdout)["batch_id"].startswith("batch_")
    assert orjson.loads(_cli("schedule", "remove", "nightly", "--json").stdout) == {"name": "nightly",
                                                                                   "removed": True}
    assert _json_error(_cli("schedule", "pause", "nightly", "--json"))["exit_code"] == 1
    rescued = _cli("rescue", "--json")
    assert set(orjson.loads(rescued.stdout)) == {"requeued", "failed", "cancelled", "lost_ingests"}
    beat = _cli("beat", "--json")  # no broker: a JSON error, exit 1
    assert beat.exit_code == 1 and "needs a broker" in _json_error(beat)["error"]["message"]


def test_results_of_a_running_job_say_partial(env: Path) -> None:
    write_requests(env / "in.jsonl", 4)
    batch = orjson.loads(_cli("submit", str(env / "in.jsonl"), "--json").stdout)
    plain = _cli("results", batch["id"], "-o", str(env / "r.jsonl"))
    assert plain.exit_code == 0
    assert "this export is partial (0 of 4 requests done)" in plain.stderr
    as_json = _cli("results", batch["id"], "-o", str(env / "r.jsonl"), "--json")
    summary = orjson.loads(as_json.stdout)
    assert summary["partial"] is True and summary["status"] == "in_progress" and summary["results"] == 0
    cancelled = _cli("cancel", batch["id"], "--json")
    assert orjson.loads(cancelled.stdout)["status"] == "cancelled"
    done = orjson.loads(_cli("results", batch["id"], "-o", str(env / "r.jsonl"), "--errors",
                             str(env / "e.jsonl"), "--json").stdout)
    assert done["partial"] is False and done["error_lines"] == 4


def test_results_of_an_unknown_batch_leave_no_file(env: Path) -> None:
    out = env / "results" / "out.jsonl"
    out.parent.mkdir()
    result = _cli("results", "batch_42", "-o", str(out), "--errors", str(env / "results" / "err.jsonl"))
    assert result.exit_code == 1 and "batch batch_42 not found" in result.stderr
    assert list(out.parent.iterdir()) == []


def test_server_option_before_or_after_the_command(env: Path) -> None:
    for args in (["--server", "http://127.0.0.1:9", "status", "batch_1"],
                 ["status", "--server", "http://127.0.0.1:9", "batch_1"]):
        result = _cli(*args, "--json")
        assert result.exit_code == 1
        assert "cannot reach http://127.0.0.1:9/v1" in _json_error(result)["error"]["message"]


# --- configuration ---------------------------------------------------------------------------------

def _config_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr  # one line, no traceback
    return lines[0]


def test_unknown_toml_key_names_the_closest_setting(env: Path, monkeypatch) -> None:
    config = env / "batchinfer.toml"
    config.write_text("shard_sise = 64\n")
    monkeypatch.setenv("BATCHINFER_CONFIG", str(config))
    line = _config_error(_cli("list"))
    assert "unknown setting 'shard_sise' (did you mean shard_size?)" in line and str(config) in line
    as_json = _cli("list", "--json")
    assert _json_error(as_json)["error"]["type"] == "config_error"


def test_unknown_environment_variable_names_the_closest(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHINFER_SHARDSIZE", "8")
    line = _config_error(_cli("list"))
    assert "unknown environment variable BATCHINFER_SHARDSIZE (did you mean BATCHINFER_SHARD_SIZE?)" in line


def test_missing_config_file_is_an_error(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHINFER_CONFIG", str(env / "nope.toml"))
    assert f"BATCHINFER_CONFIG={env / 'nope.toml'}: no such file" in _config_error(_cli("config", "show"))


def test_invalid_values_name_the_setting_and_where_it_came_from(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHINFER_SHARD_SIZE", "abc")
    line = _config_error(_cli("list"))
    assert "invalid setting shard_size = 'abc' (from env BATCHINFER_SHARD_SIZE)" in line
    monkeypatch.delenv("BATCHINFER_SHARD_SIZE")
    get_settings.cache_clear()
    config = env / "batchinfer.toml"
    config.write_text("api_port = 99999\n")
    monkeypatch.setenv("BATCHINFER_CONFIG", str(config))
    line = _config_error(_cli("config", "show"))
    assert f"invalid setting api_port = 99999 (from file {config})" in line and "65535" in line
    config.write_text("api_port = \n")
    assert f"config file {config}:" in _config_error(_cli("config", "show"))


def test_config_show_sources(env: Path, monkeypatch) -> None:
    config = env / "batchinfer.toml"
    config.write_text("shard_size = 64\nmax_num_seqs = 8\n")
    monkeypatch.setenv("BATCHINFER_CONFIG", str(config))
    monkeypatch.setenv("BATCHINFER_MAX_NUM_SEQS", "16")
    shown = orjson.loads(_cli("config", "show", "--sources", "--json").stdout)
    assert shown["shard_size"] == {"value": 64, "source": f"file {config}"}
    assert shown["max_num_seqs"] == {"value": 16, "source": "env BATCHINFER_MAX_NUM_SEQS"}
    assert shown["lease_seconds"]["source"] == "default"
    text = _cli("config", "show", "--sources").stdout
    assert any(line.startswith("shard_size") and line.endswith(f"(file {config})")
               for line in text.splitlines())


def test_every_batchinfer_variable_read_in_the_code_is_known() -> None:
    """A BATCHINFER_* variable read anywhere but Settings must be listed in config_sources.OTHER_ENV_VARS,
    else the unknown-variable check would refuse it."""
    import re

    from batchinfer.config import Settings
    from batchinfer.config_sources import ENV_PREFIX, OTHER_ENV_VARS, TEST_ENV_PREFIX

    root = Path(__file__).resolve().parents[2]
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | OTHER_ENV_VARS
    seen: set[str] = set()
    for folder in ("batchinfer", "workers", "bench", "docker", "examples", ".ci"):
        for path in (root / folder).rglob("*"):
            if path.is_file() and path.suffix in {"", ".py", ".sh", ".yml", ".yaml", ".toml"}:
                seen |= set(re.findall(r"BATCHINFER_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore")))
    seen |= set(re.findall(r"BATCHINFER_[A-Z0-9_]*[A-Z0-9]", (root / "README.md").read_text()))
    unknown = {name for name in seen - known if not (name + "_").startswith(TEST_ENV_PREFIX)}
    assert unknown == set(), (f"add these to batchinfer.config_sources.OTHER_ENV_VARS or Settings: "
                              f"{sorted(unknown)}")
