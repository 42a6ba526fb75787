"""/v1/batches: create, retrieve, list, cancel; bad requests; results through the files API."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
from fastapi.testclient import TestClient

from batchinfer.api.routes import batches as batches_route
from tests.api.conftest import TEST_MODEL
from tests.api.helpers import FixedOutputWorker, chat_line, completion_line, jsonl, serve

OPENAI_BATCH_KEYS = {
    "id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status", "output_file_id",
    "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
    "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts", "metadata", "usage",
    "model",
}
CHAT = "/v1/chat/completions"


def upload(client: TestClient, auth: dict[str, str], content: bytes) -> str:
    response = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                           files={"file": ("in.jsonl", content, "application/jsonl")})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def create(client: TestClient, auth: dict[str, str], file_id: str, **extra) -> dict:
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **extra}
    response = client.post("/v1/batches", headers=auth, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def wait_status(client: TestClient, auth: dict[str, str], batch_id: str, statuses: set[str],
                timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.get(f"/v1/batches/{batch_id}", headers=auth).json()
        if batch["status"] in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch['status']}"
        time.sleep(0.02)


def lines_of(client: TestClient, auth: dict[str, str], file_id: str) -> list[dict]:
    response = client.get(f"/v1/files/{file_id}/content", headers=auth)
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines()]


def test_batch_runs_to_completion_with_openai_shapes(client, auth, factory):
    file_id = upload(client, auth, jsonl([chat_line(f"q{i}", f"question {i}") for i in range(10)]))
    batch = create(client, auth, file_id, metadata={"team": "nlp"})
    assert set(batch) >= OPENAI_BATCH_KEYS and "progress" in batch
    assert batch["id"].startswith("batch_") and batch["object"] == "batch" and batch["endpoint"] == CHAT
    assert batch["status"] == "in_progress" and batch["input_file_id"] == file_id
    assert batch["request_counts"] == {"total": 10, "completed": 0, "failed": 0}
    assert batch["metadata"] == {"team": "nlp"} and batch["model"] == TEST_MODEL
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert batch["output_file_id"] is None and batch["progress"]["fraction"] == 0.0

    with FixedOutputWorker(factory, model=TEST_MODEL):
        done = wait_status(client, auth, batch["id"], {"completed", "failed"})
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
    assert done["completed_at"] >= done["in_progress_at"] >= done["created_at"]
    assert done["usage"]["input_tokens"] == 30 and done["usage"]["output_tokens"] == 20
    assert done["usage"]["total_tokens"] == 50
    assert done["progress"]["fraction"] == 1.0 and done["error_file_id"] is None

    output = lines_of(client, auth, done["output_file_id"])
    assert [line["custom_id"] for line in output] == [f"q{i}" for i in range(10)]
    first = output[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["body"]["object"] == "chat.completion"
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "echo:q0"
    meta = client.get(f"/v1/files/{done['output_file_id']}", headers=auth).json()
    assert meta["purpose"] == "batch_output" and meta["object"] == "file"
    size = len(client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth).content)
    assert meta["bytes"] == size


def test_bad_lines_are_reported_with_line_numbers_and_land_in_the_error_file(client, auth, factory):
    content = jsonl([chat_line("ok-1", "hi"), b'{"custom_id": "broken", ', chat_line("ok-1", "dup"),
                     chat_line("ok-2", "there")])
    batch = create(client, auth, upload(client, auth, content))
    assert batch["status"] == "in_progress"
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 2}
    errors = batch["errors"]["data"]
    assert errors[0]["line"] == 2 and errors[0]["code"] == "invalid_json"
    assert errors[1]["line"] == 3 and errors[1]["code"] == "duplicate_custom_id"
    with FixedOutputWorker(factory, model=TEST_MODEL):
        done = wait_status(client, auth, batch["id"], {"completed"})
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert [line["custom_id"] for line in lines_of(client, auth, done["output_file_id"])] == ["ok-1", "ok-2"]
    error_lines = lines_of(client, auth, done["error_file_id"])
    assert [line["error"]["code"] for line in error_lines] == ["invalid_json", "duplicate_custom_id"]
    assert all(line["response"] is None for line in error_lines)


def test_lines_must_match_the_batch_endpoint(client, auth):
    mixed = jsonl([chat_line("c1", "hi"), completion_line("p1", "Once upon")])
    batch = create(client, auth, upload(client, auth, mixed))
    assert batch["status"] == "in_progress" and batch["request_counts"]["failed"] == 1
    assert batch["errors"]["data"][0] == {"code": "invalid_url", "line": 2, "param": "url",
                                          "message": batch["errors"]["data"][0]["message"]}
    assert "/v1/chat/completions" in batch["errors"]["data"][0]["message"]
    only_chat = jsonl([chat_line("c1", "hi")])
    failed = create(client, auth, upload(client, auth, only_chat), endpoint="/v1/completions")
    assert failed["status"] == "failed" and failed["failed_at"] is not None
    assert failed["errors"]["data"][0]["code"] == "invalid_file"


@pytest.mark.parametrize(("body", "status", "param", "says"), [
    ({"input_file_id": "file-424242"}, 404, "input_file_id", "file-424242"),
    ({"input_file_id": "garbage"}, 404, "input_file_id", "no such file"),
    ({"endpoint": "/v1/moderations"}, 400, "endpoint", "unsupported endpoint"),
    ({"completion_window": "soon"}, 400, "completion_window", "completion_window"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "16"),
    ({"metadata": {"k": "v" * 600}}, 400, "metadata", "512"),
    ({"input_file_id": None}, 400, "input_file_id", "input_file_id"),
    ({"endpoint": 5}, 400, "endpoint", "endpoint"),
])
def test_bad_create_requests_get_clear_4xx(client, auth, body, status, param, says):
    file_id = upload(client, auth, jsonl([chat_line("a", "hi")]))
    request = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **body}
    response = client.post("/v1/batches", headers=auth, json=request)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says.lower() in error["message"].lower(), error


def test_missing_fields_and_non_json_bodies_are_400(client, auth):
    response = client.post("/v1/batches", headers=auth, json={"endpoint": CHAT})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Missing required parameter: 'input_file_id'."
    response = client.post("/v1/batches", headers={**auth, "Content-Type": "application/json"},
                           content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_list_is_newest_first_with_cursor(client, auth, make_key):
    file_id = upload(client, auth, jsonl([chat_line("a", "hi")]))
    ids = [create(client, auth, file_id)["id"] for _ in range(5)]
    page = client.get("/v1/batches", headers=auth, params={"limit": 2}).json()
    assert page["object"] == "list" and [b["id"] for b in page["data"]] == ids[::-1][:2]
    assert page["first_id"] == ids[-1] and page["last_id"] == ids[-2] and page["has_more"] is True
    seen = [b["id"] for b in page["data"]]
    while page["has_more"]:
        page = client.get("/v1/batches", headers=auth, params={"limit": 2, "after": page["last_id"]}).json()
        seen += [b["id"] for b in page["data"]]
    assert seen == ids[::-1]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"after": "file-1"}, "after")):
        response = client.get("/v1/batches", headers=auth, params=params)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_cancel_idle_batch_is_immediate_and_completed_batch_cannot_be_cancelled(client, auth, factory):
    file_id = upload(client, auth, jsonl([chat_line(f"q{i}", "hi") for i in range(6)]))
    batch = create(client, auth, file_id)
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth).json()
    assert cancelled["status"] == "cancelled" and cancelled["cancelling_at"] and cancelled["cancelled_at"]
    again = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"  # idempotent

    done_batch = create(client, auth, file_id)
    with FixedOutputWorker(factory, model=TEST_MODEL):
        wait_status(client, auth, done_batch["id"], {"completed"})
    response = client.post(f"/v1/batches/{done_batch['id']}/cancel", headers=auth)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_batch_status"
    assert "completed" in response.json()["error"]["message"]


def test_cancel_while_a_worker_runs_goes_through_cancelling(client, auth, factory):
    file_id = upload(client, auth, jsonl([chat_line(f"q{i}", "hi") for i in range(12)]))
    batch = create(client, auth, file_id)
    with FixedOutputWorker(factory, model=TEST_MODEL, delay_s=0.05) as worker:
        deadline = time.monotonic() + 20
        while worker.done_requests == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cancelling = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth).json()
        assert cancelling["status"] == "cancelling"
        final = wait_status(client, auth, batch["id"], {"cancelled"})
    counts = final["request_counts"]
    assert counts["total"] == 12 and 0 < counts["completed"] < 12
    error_lines = lines_of(client, auth, final["error_file_id"]) if final["error_file_id"] else []
    output = lines_of(client, auth, final["output_file_id"])
    assert len(output) == counts["completed"]
    assert all(line["error"]["code"] == "batch_cancelled" for line in error_lines)


def test_idempotency_key_returns_the_same_batch(client, auth):
    file_id = upload(client, auth, jsonl([chat_line("a", "hi")]))
    headers = {**auth, "Idempotency-Key": "nightly-2024-01-01"}
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    first = client.post("/v1/batches", headers=headers, json=body).json()
    second = client.post("/v1/batches", headers=headers, json=body).json()
    assert first["id"] == second["id"]
    assert client.get("/v1/batches", headers=auth).json()["data"][0]["id"] == first["id"]


def test_large_ingest_answers_validating_and_never_blocks_the_event_loop(api_settings, auth, monkeypatch):
    from batchinfer.api.app import create_app

    settings = api_settings.model_copy(update={"max_upload_bytes": 64 << 20, "shard_size": 1000})
    app = create_app(settings)
    content = jsonl([chat_line(f"q{i}", f"question number {i}") for i in range(30_000)])
    import httpx

    with serve(app) as base, httpx.Client(base_url=base, headers=auth, timeout=120) as http:
        file_id = http.post("/v1/files", data={"purpose": "batch"},
                            files={"file": ("big.jsonl", content)}).json()["id"]
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}

        # 1. The create request waits for ingest; meanwhile the server keeps answering polls.
        monkeypatch.setattr(batches_route, "SUBMIT_WAIT_S", 120.0)
        answered_during_ingest = 0
        created: dict = {}
        poster = threading.Thread(target=lambda: created.update(http.post("/v1/batches", json=body).json()))
        poster.start()
        while poster.is_alive():
            assert http.get("/healthz").status_code == 200
            answered_during_ingest += poster.is_alive()
        poster.join()
        assert created["status"] == "in_progress" and created["request_counts"]["total"] == 30_000
        assert answered_during_ingest > 0

        # 2. With a short wait the answer is `validating`, and polling sees the ingest finish.
        monkeypatch.setattr(batches_route, "SUBMIT_WAIT_S", 0.0)
        early = http.post("/v1/batches", json=body).json()
        assert early["status"] == "validating" and early["request_counts"]["total"] == 0
        deadline = time.monotonic() + 60
        while http.get(f"/v1/batches/{early['id']}").json()["status"] == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.get(f"/v1/batches/{early['id']}").json()["request_counts"]["total"] == 30_000


@pytest.mark.postgres
def test_whole_flow_on_postgres(pg_url, tmp_path):
    """Same API over PostgreSQL."""
    from batchinfer.api.app import create_app
    from batchinfer.store.apikeys import create_key
    from batchinfer.store.db import session_factory, upgrade
    from tests.api.conftest import make_settings

    upgrade(pg_url)
    app = create_app(make_settings(tmp_path, pg_url))
    pg_factory = session_factory(pg_url)
    with pg_factory() as session:
        key, _ = create_key(session, name="pg")
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(app) as client:
        file_id = upload(client, auth, jsonl([chat_line(f"q{i}", "hi") for i in range(6)]))
        batch = create(client, auth, file_id)
        assert batch["status"] == "in_progress"
        with FixedOutputWorker(pg_factory, model=TEST_MODEL):
            done = wait_status(client, auth, batch["id"], {"completed"})
        assert [line["custom_id"] for line in lines_of(client, auth, done["output_file_id"])] == \
            [f"q{i}" for i in range(6)]
        assert client.get("/v1/batches", headers=auth).json()["data"][0]["id"] == batch["id"]
        assert client.get("/v1/batches", headers={"Authorization": "Bearer bi-nope"}).status_code == 401


def test_polls_refresh_last_used_at_once_then_read_without_writing(client, factory, make_key):
    from sqlalchemy import select

    from batchinfer.store.models import ApiKey

    key, key_id = make_key("poller")
    auth = {"Authorization": f"Bearer {key}"}
    batch = create(client, auth, upload(client, auth, jsonl([chat_line("a", "hi")])))
    with factory() as session:
        first_use = session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id))
    assert first_use is not None
    for _ in range(5):
        assert client.get(f"/v1/batches/{batch['id']}", headers=auth).status_code == 200
    with factory() as session:
        assert session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id)) == first_use


def test_an_embeddings_batch_is_accepted_and_its_lines_validated(client, auth):
    lines = [orjson.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                           "body": {"input": [f"text {i}", "more"]}}) for i in range(3)]
    lines.append(orjson.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                               "body": {"input": "x", "dimensions": 8}}))
    batch = create(client, auth, upload(client, auth, jsonl(lines)), endpoint="/v1/embeddings")
    assert batch["endpoint"] == "/v1/embeddings" and batch["status"] == "in_progress", batch
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 1}
