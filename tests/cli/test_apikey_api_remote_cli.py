"""`batchinfer apikey ...`, `batchinfer api` (auth-disabled guard) and the CLI's RemoteClient."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchinfer.api.app import create_app
from batchinfer.cli.api_cmd import api
from batchinfer.cli.apikey_cmd import apikey
from batchinfer.cli.remote import RemoteClient, RemoteError
from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from tests.api.conftest import TEST_MODEL, make_settings
from tests.api.helpers import FixedOutputWorker, chat_line, completion_line, jsonl, key_maker, serve


@pytest.fixture
def api_settings(tmp_path: Path, sqlite_url: str) -> Settings:
    """Settings of a server on a migrated, empty SQLite database (as in tests/api)."""
    upgrade(sqlite_url)
    return make_settings(tmp_path, sqlite_url)


@pytest.fixture
def factory(api_settings: Settings):
    """Sessions on the server's database."""
    return session_factory(api_settings.effective_database_url)


@pytest.fixture
def make_key(factory):
    """Create an API key: make_key(name, owner=None) -> (plaintext, key id)."""

    return key_maker(factory)


@pytest.fixture
def cli_env(tmp_path: Path, sqlite_url: str, monkeypatch) -> dict[str, str]:
    from batchinfer.config import get_settings

    monkeypatch.setenv("BATCHINFER_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    return {"BATCHINFER_DATABASE_URL": sqlite_url}


def test_apikey_create_list_revoke(cli_env, tmp_path):
    runner = CliRunner()
    created = runner.invoke(apikey, ["create", "--name", "ci-nightly"])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip().splitlines()[0]
    assert key.startswith("bi-") and "will not be shown again" in created.stderr

    listed = runner.invoke(apikey, ["list"])
    assert listed.exit_code == 0 and "ci-nightly" in listed.stdout and key[:10] in listed.stdout
    assert key not in listed.stdout  # never the whole key

    revoked = runner.invoke(apikey, ["revoke", "1"])
    assert revoked.exit_code == 0 and "revoked key 1" in revoked.stdout
    assert "ci-nightly" not in runner.invoke(apikey, ["list"]).stdout
    assert "ci-nightly" in runner.invoke(apikey, ["list", "--all"]).stdout
    missing = runner.invoke(apikey, ["revoke", "99"])
    assert missing.exit_code != 0 and "no API key with id 99" in missing.output


def test_api_refuses_auth_disabled_off_loopback(cli_env, monkeypatch):
    import uvicorn

    started: list[uvicorn.Config] = []  # the api command serves through uvicorn.Server: record, do not bind
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, **kw: started.append(server.config))
    refused = CliRunner().invoke(api, ["--auth-disabled", "--host", "0.0.0.0"])
    assert refused.exit_code == 2 and "refused on 0.0.0.0" in refused.output and not started

    served = CliRunner().invoke(api, ["--auth-disabled", "--host", "127.0.0.1", "--port", "8123"])
    assert served.exit_code == 0, served.output
    assert "authentication is DISABLED" in served.stderr
    assert started[0].host == "127.0.0.1" and started[0].port == 8123
    assert started[0].app.state.settings.auth_disabled is True

    keyed = CliRunner().invoke(api, ["--host", "0.0.0.0"])
    assert keyed.exit_code == 0 and "DISABLED" not in keyed.output


def test_remote_client_round_trip(api_settings, factory, make_key, tmp_path, monkeypatch):
    import batchinfer.cli.remote as remote_module

    key, _ = make_key("alice")
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"c{i}", "hi") for i in range(4)] + [completion_line("p", "Once")]))
    with serve(create_app(api_settings)) as base, RemoteClient(base, key) as remote:
        batch = remote.submit(path, metadata={"source": "cli"})
        assert batch.status == "in_progress" and batch.metadata == {"source": "cli"}
        assert batch.endpoint is None and batch.model == TEST_MODEL  # a mixed file: lines use both
        assert batch.request_counts.model_dump() == {"total": 5, "completed": 0, "failed": 0}
        other = remote.submit(path, model="another-model", idempotency_key="nightly-1")
        assert other.model == "another-model"
        assert remote.submit(path, model="another-model", idempotency_key="nightly-1").id == other.id
        assert remote.cancel(other.id).status == "cancelled"
        with FixedOutputWorker(factory, model=TEST_MODEL):
            deadline = time.monotonic() + 30
            while (batch := remote.get(batch.id)).status != "completed":
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert batch.progress.fraction == 1.0
        page = remote.list(limit=1)
        assert [b.id for b in page.data] == [other.id] and page.has_more
        assert [b.id for b in remote.list(limit=5, after=page.last_id).data] == [batch.id]
        assert [b.id for b in remote.list(limit=500).data] == [other.id, batch.id]  # > one page
        monkeypatch.setattr(remote_module, "MAX_PAGE", 1)  # pages of one: the client follows last_id
        assert [b.id for b in remote.list(limit=3).data] == [other.id, batch.id]
        lines = list(remote.content(batch.output_file_id))
        assert len(lines) == 5 and all(line.endswith(b"\n") for line in lines)

        with pytest.raises(RemoteError, match="No such batch") as missing:
            remote.get("batch_999")
        assert missing.value.status_code == 404 and missing.value.param == "batch_id"
        with pytest.raises(RemoteError, match="No such File"):
            list(remote.content("file-out-999"))
    with RemoteClient(base, key) as gone, pytest.raises(RemoteError, match="cannot reach"):
        gone.get("batch_1")


def test_remote_client_reports_auth_errors(api_settings):
    with serve(create_app(api_settings)) as base, RemoteClient(base, "bi-wrong") as remote:
        with pytest.raises(RemoteError, match="Incorrect API key") as error:
            remote.list()
        assert error.value.status_code == 401 and error.value.code == "invalid_api_key"
