"""Issue 28 item 2, as a tenant sees it: another tenant's slow batch ingests (distinct large JSON Schemas,
each converted by xgrammar) do not starve the API's ingest threads; owners take turns (fair_pool.py)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from batchinfer.api.app import create_app
from batchinfer.api.deps import ingest_pool
from batchinfer.store.db import session_factory, upgrade
from tests.api.conftest import make_settings
from tests.api.helpers import chat_line, jsonl, key_maker, serve

CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


def _slow_file(seed: int, lines: int = 80) -> bytes:
    """Lines whose schemas are each distinct and ~20 KB: ~40 ms of conversion each, ~3 s a file."""
    out = []
    for i in range(lines):
        schema = {"anyOf": [{"type": "object", "properties": {f"k{seed}_{i}_{j}": {"type": "integer"}}}
                            for j in range(300)]}
        response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        out.append(json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": "hi"}],
                                        "response_format": response_format}}))
    return ("\n".join(out) + "\n").encode()


def _wait_until(condition, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_one_tenants_slow_ingests_leave_a_thread_to_another_tenant(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, max_upload_bytes=8 << 20)
    keys = key_maker(session_factory(sqlite_url))
    alice = {"Authorization": f"Bearer {keys('alice')[0]}"}
    bob = {"Authorization": f"Bearer {keys('bob')[0]}"}
    app = create_app(settings)
    with serve(app) as url, httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(2) as bg:
        slow_ids = [client.post("/v1/files", headers=alice, data={"purpose": "batch"},
                                files={"file": ("a.jsonl", _slow_file(seed))}).json()["id"]
                    for seed in (1, 2)]
        quick_id = client.post("/v1/files", headers=bob, data={"purpose": "batch"},
                               files={"file": ("b.jsonl", jsonl([chat_line("q", "hi")]))}).json()["id"]
        slow = [bg.submit(client.post, "/v1/batches", headers=alice,
                          json={"input_file_id": file_id, **CREATE}) for file_id in slow_ids]
        _wait_until(lambda: ingest_pool(app).load("alice") == 2)  # both of alice's ingests are in
        start = time.monotonic()
        quick = client.post("/v1/batches", headers=bob, json={"input_file_id": quick_id, **CREATE})
        waited = time.monotonic() - start
        # Before: two ingest threads, first come first served: bob's waited for alice's (~3 s each) and
        # its create answered `validating` after 2 s.
        assert quick.status_code == 200 and quick.json()["status"] == "in_progress", (quick.text, waited)
        assert ingest_pool(app).load("alice") >= 1  # alice's are still going
        for future in slow:
            assert future.result().status_code == 200
        # alice's ingests finish before the app stops: left running, they outlive this test and count
        # in the next test's process-wide metrics (api_ingested_requests_total).
        batch_urls = [f"/v1/batches/{future.result().json()['id']}" for future in slow]

        def statuses() -> list[str]:
            return [client.get(url, headers=alice).json()["status"] for url in batch_urls]

        _wait_until(lambda: "validating" not in statuses(), 120)
        assert statuses() == ["in_progress", "in_progress"]
        _wait_until(lambda: ingest_pool(app).load("alice") == 0)  # its thread counts the requests, then frees
