"""Settings come from defaults, the environment and an optional TOML file, in that order of precedence."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from batchinfer.config import Settings, mask_url_password


def test_defaults_are_local_mode_with_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    settings = Settings()
    assert settings.local_mode
    assert settings.effective_database_url == f"sqlite:///{tmp_path / 'batchinfer.db'}"
    assert settings.default_model == "smollm2-135m-instruct"


def test_environment_beats_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "batchinfer.toml"
    config.write_text('shard_size = 64\nbroker_url = "redis://localhost:6379/0"\n')
    monkeypatch.setenv("BATCHINFER_CONFIG", str(config))
    assert Settings().shard_size == 64
    assert not Settings().local_mode
    monkeypatch.setenv("BATCHINFER_SHARD_SIZE", "8")
    assert Settings().shard_size == 8


def test_invalid_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_SHARD_SIZE", "0")
    with pytest.raises(ValueError, match="shard_size"):
        Settings()


def test_config_show_masks_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", "postgresql+psycopg://app:hunter2@db:5432/jobs")
    monkeypatch.setenv("BATCHINFER_API_KEY", "sk-very-secret")
    result = CliRunner().invoke(main, ["config", "show", "--json"])
    assert result.exit_code == 0, result.output
    assert "hunter2" not in result.output and "sk-very-secret" not in result.output
    shown = orjson.loads(result.output)
    assert shown["database_url"] == "postgresql+psycopg://app:****@db:5432/jobs"
    assert shown["api_key"] == "********"


def test_mask_url_password_leaves_plain_urls() -> None:
    assert mask_url_password("sqlite:///x.db") == "sqlite:///x.db"
    assert mask_url_password("redis://h:6379/0") == "redis://h:6379/0"
