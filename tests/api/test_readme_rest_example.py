"""The README's REST example runs as printed (issue 29, item 9): the file it uploads is one the API
accepts (a single endpoint: the API refuses a file that mixes them, as OpenAI does)."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from batchinfer.api.app import create_app
from batchinfer.store.db import upgrade
from tests.api.conftest import make_settings
from tests.api.helpers import key_maker

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_openai_example_file_is_accepted_whole(tmp_path: Path, sqlite_url: str) -> None:
    readme = (ROOT / "README.md").read_text()
    upload = re.search(r'client\.files\.create\(file=open\("([^"]+)", "rb"\)', readme).group(1)
    endpoint = re.search(r'client\.batches\.create\(input_file_id=batch_file\.id, endpoint="([^"]+)"',
                         readme).group(1)
    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, default_model="smollm2-135m-instruct")
    app = create_app(settings)
    with TestClient(app) as client:
        from batchinfer.store.db import session_factory

        key, _ = key_maker(session_factory(sqlite_url))("alice")
        headers = {"Authorization": f"Bearer {key}"}
        uploaded = client.post("/v1/files", headers=headers, data={"purpose": "batch"},
                               files={"file": (Path(upload).name, (ROOT / upload).read_bytes())})
        assert uploaded.status_code == 200, uploaded.text
        created = client.post("/v1/batches", headers=headers, json={
            "input_file_id": uploaded.json()["id"], "endpoint": endpoint, "completion_window": "24h"})
        assert created.status_code == 200, created.text
        batch = created.json()
    lines = (ROOT / upload).read_bytes().count(b"\n")
    assert batch["status"] == "in_progress", batch.get("errors")
    assert batch["request_counts"] == {"total": lines, "completed": 0, "failed": 0}
