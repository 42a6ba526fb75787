"""POST /v1/batches/estimate (issue 32): an uploaded batch file's figures on a served model, the same as
`batchinfer estimate` prints; another owner's file is not found, an unserved model refused."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from batchinfer.api.app import create_app
from batchinfer.store.db import session_factory, upgrade
from tests.api.conftest import make_settings
from tests.api.helpers import key_maker
from tests.workers.helpers import write_requests


def test_an_uploaded_file_is_estimated_on_a_served_model(tmp_path: Path, sqlite_url: str,
                                                         tiny_llama: Path) -> None:
    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, default_model=str(tiny_llama))
    make = key_maker(session_factory(sqlite_url))
    alice = {"Authorization": f"Bearer {make('alice')[0]}"}
    bob = {"Authorization": f"Bearer {make('bob')[0]}"}
    write_requests(tmp_path / "in.jsonl", 5, extra_lines=[b"not json"])
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        uploaded = client.post("/v1/files", headers=alice, data={"purpose": "batch"},
                               files={"file": ("in.jsonl", (tmp_path / "in.jsonl").read_bytes())}).json()
        response = client.post("/v1/batches/estimate", headers=alice, json={"input_file_id": uploaded["id"]})
        assert response.status_code == 200, response.text
        figures = response.json()
        assert figures["requests"] == 5 and figures["invalid_lines"] == 1
        assert figures["errors"][0]["message"].startswith("line 6: ")
        assert figures["prompt_tokens"] > figures["cached_prompt_tokens"] > 0
        assert figures["max_output_tokens"] == sum(6 + i % 3 for i in range(5))
        assert figures["expected_seconds"] is None and figures["basis"]

        other = client.post("/v1/batches/estimate", headers=bob, json={"input_file_id": uploaded["id"]})
        assert other.status_code == 404
        unserved = client.post("/v1/batches/estimate", headers=alice,
                               json={"input_file_id": uploaded["id"], "model": "/etc"})
        assert unserved.status_code == 400 and unserved.json()["error"]["param"] == "model"
