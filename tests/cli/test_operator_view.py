"""The operator's view (issue 29 item 3): the local CLI sees and acts on every owner's batches, an admin
key's dashboard shows them all (CLI jobs of owner `local` included), and an ordinary key still sees only
its own.

Driven as people do it: keys made with `batchinfer apikey create`, a tenant's batch through the REST API,
the operator's through `batchinfer submit`, then the CLI commands and the dashboard's routes.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from batchinfer.api.app import create_app
from batchinfer.config import Settings
from batchinfer.store import LOCAL_OWNER
from tests.workers.helpers import write_requests

HTMX = {"HX-Request": "true"}


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main_command(), list(args), catch_exceptions=False)
    return result.exit_code, result.output


def main_command():  # noqa: ANN201 - the click group
    from batchinfer.cli import main

    return main


def _key(*args: str) -> str:
    code, out = _cli("apikey", "create", *args, "--json")
    assert code == 0, out
    return orjson.loads(out)["key"]


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A database with alice's batch (REST), the operator's own (CLI), and keys for alice, bob, ops."""
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", "m")  # no worker: the batches wait, in_progress
    write_requests(tmp_path / "in.jsonl", 3)
    keys = {"alice": _key("--name", "alice"), "bob": _key("--name", "bob"),
            "ops": _key("--name", "ops", "--admin")}
    code, out = _cli("submit", str(tmp_path / "in.jsonl"), "--json")
    assert code == 0, out
    local_id = orjson.loads(out)["id"]
    app = create_app(Settings(data_dir=tmp_path / "data", default_model="m"), auth_cache_ttl_s=0)
    client = TestClient(app)
    auth = {"Authorization": f"Bearer {keys['alice']}"}
    uploaded = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                           files={"file": ("in.jsonl", (tmp_path / "in.jsonl").read_bytes())})
    assert uploaded.status_code == 200, uploaded.text
    created = client.post("/v1/batches", headers=auth, json={"input_file_id": uploaded.json()["id"],
                                                              "endpoint": "/v1/chat/completions",
                                                              "completion_window": "24h"})
    assert created.status_code == 200, created.text
    return {"keys": keys, "local": local_id, "alice": created.json()["id"], "app": app, "tmp": tmp_path}


def _ids(out: str) -> list[str]:
    return [orjson.loads(line)["id"] for line in out.splitlines() if line.strip()]


def test_the_local_cli_lists_and_acts_on_every_owners_batches(world: dict) -> None:
    local, alice = world["local"], world["alice"]
    code, out = _cli("list", "--json")
    assert code == 0 and _ids(out) == [local]  # the default: the CLI's own jobs
    code, out = _cli("list", "--all-owners", "--json")
    assert code == 0 and _ids(out) == [alice, local]
    assert [orjson.loads(line)["owner"] for line in out.splitlines()] == ["alice", LOCAL_OWNER]
    code, out = _cli("list", "--owner", "alice")
    assert code == 0 and alice in out and local not in out and "owner alice" in out
    code, out = _cli("list", "--all-owners")
    assert f"owner {LOCAL_OWNER}" in out and "owner alice" in out

    code, out = _cli("status", alice, "--json")
    assert code == 0 and orjson.loads(out)["owner"] == "alice"
    code, out = _cli("results", alice, "-o", str(world["tmp"] / "alice.jsonl"))
    assert code == 0 and (world["tmp"] / "alice.jsonl").exists(), out
    code, out = _cli("cancel", alice)
    assert code == 0 and "cancelled" in out and "owner alice" in out
    code, out = _cli("cancel", alice)
    assert code == 0  # cancelling a cancelled batch returns it

    code, out = _cli("list", "--owner", "alice", "--all-owners")
    assert code == 1 and "give one of them" in out
    code, out = _cli("--server", "http://127.0.0.1:9", "list", "--all-owners")
    assert code == 1 and "without --server" in out


def test_an_admin_keys_dashboard_sees_every_owner_and_others_only_their_own(world: dict) -> None:
    local, alice = world["local"], world["alice"]
    ops = TestClient(world["app"])
    signed_in = ops.post("/ui/login", data={"api_key": world["keys"]["ops"]}, follow_redirects=False)
    assert signed_in.status_code == 303
    home = ops.get("/ui")
    assert home.status_code == 200 and "All owners' batches" in home.text and "(admin" in home.text
    jobs = ops.get("/ui/jobs").text
    assert local in jobs and alice in jobs and 'data-owner="local"' in jobs and 'data-owner="alice"' in jobs
    page = ops.get(f"/ui/batches/{local}")
    assert page.status_code == 200 and 'id="batch-owner">local<' in page.text
    download = ops.get(f"/ui/batches/{alice}/download/output")
    assert download.status_code == 200 and "attachment" in download.headers["content-disposition"]
    cancelled = ops.post(f"/ui/batches/{local}/cancel", headers=HTMX)
    assert cancelled.status_code == 200 and 'data-status="cancelled"' in cancelled.text
    code, out = _cli("status", local, "--json")
    assert orjson.loads(out)["status"] == "cancelled"

    for owner, own, other in (("alice", alice, local), ("bob", None, alice)):
        client = TestClient(world["app"])
        client.post("/ui/login", data={"api_key": world["keys"][owner]})
        jobs = client.get("/ui/jobs").text
        assert (own is None or own in jobs) and other not in jobs and "data-owner" not in jobs
        assert client.get(f"/ui/batches/{other}").status_code == 404
        assert client.get(f"/ui/batches/{other}/download/output").status_code == 404
        refused = client.post(f"/ui/batches/{other}/cancel", headers=HTMX)
        assert refused.status_code == 404
    code, out = _cli("status", alice, "--json")
    assert orjson.loads(out)["status"] == "in_progress"  # bob's cancel did nothing


def test_apikey_list_marks_admin_keys(world: dict) -> None:
    code, out = _cli("apikey", "list", "--json")
    admins = {row["name"]: row["admin"] for row in map(orjson.loads, out.splitlines())}
    assert admins == {"alice": False, "bob": False, "ops": True}
    code, out = _cli("apikey", "list")
    assert "ops (admin)" in out and "alice (admin)" not in out
