"""Issue 15 at the API: bounded upload bodies, the auth-disabled loopback guard, /metrics token and labels."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from batchinfer.api.app import create_app
from batchinfer.api.loopback import refusal
from batchinfer.config import Settings
from tests.api.conftest import TEST_MODEL, make_settings
from tests.api.helpers import chat_line, jsonl

GOOD = jsonl([chat_line("a", "hello"), chat_line("b", "world")])
BOUNDARY = "xyzBOUNDARYzyx"


def _fields_body(count: int, size: int) -> Iterator[bytes]:
    """A multipart body of `count` small fields of `size` bytes, then a file, yielded in pieces (chunked)."""
    for i in range(count):
        yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"f{i}\"\r\n\r\n".encode()
               + b"v" * size + b"\r\n")
    yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
           f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n"
           ).encode() + GOOD + f"\r\n--{BOUNDARY}--\r\n".encode()


def _post_chunked(client: TestClient, auth: dict[str, str], body: Iterator[bytes]):
    headers = {**auth, "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    return client.post("/v1/files", headers=headers, content=body)  # a generator: Transfer-Encoding chunked


def test_many_small_fields_are_413(client, auth, api_settings: Settings) -> None:
    response = _post_chunked(client, auth, _fields_body(api_settings.max_form_fields, 10))
    assert response.status_code == 413, response.text
    assert "max_form_fields" in response.json()["error"]["message"]
    assert _post_chunked(client, auth, _fields_body(2, 10)).status_code == 200  # a few extra fields: fine


def test_a_chunked_body_over_the_upload_limit_is_413(tmp_path: Path, sqlite_url: str, auth) -> None:
    # The issue: 24 MB of fields answered 200 under a 1 MiB limit. Fields are many here on purpose.
    from batchinfer.store.db import upgrade

    upgrade(sqlite_url)
    app = create_app(make_settings(tmp_path, sqlite_url, max_form_fields=100_000))
    with TestClient(app) as client:
        from batchinfer.store.apikeys import create_key
        from batchinfer.store.db import session_factory

        with session_factory(sqlite_url)() as session:
            key, _ = create_key(session, name="alice")
        response = _post_chunked(client, {"Authorization": f"Bearer {key}"}, _fields_body(6000, 4000))
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "file_too_large"
    assert list((tmp_path / "data" / "files").iterdir()) == []


@pytest.fixture
def open_app(tmp_path: Path, sqlite_url: str):
    from batchinfer.store.db import upgrade

    upgrade(sqlite_url)
    return create_app(make_settings(tmp_path, sqlite_url, auth_disabled=True))


def _upload(client: TestClient, **headers: str):
    return client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", GOOD)},
                       headers=headers)


def test_auth_disabled_refuses_a_foreign_origin_or_host(open_app) -> None:
    with TestClient(open_app, base_url="http://127.0.0.1:8000") as client:
        assert _upload(client).status_code == 200
        assert _upload(client, Origin="http://localhost:8000").status_code == 200
        for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"},
                        {"Host": "rebound.example:8000"}):
            response = _upload(client, **headers)
            assert response.status_code == 403, headers
            assert response.json()["error"]["code"] == "not_loopback"
        assert client.post("/v1/batches/batch_1/cancel", headers={"Origin": "https://evil.example"}
                           ).status_code == 403
    with TestClient(open_app, base_url="http://192.168.1.5:8000") as client:  # came in on a LAN address
        response = client.get("/v1/files")
        assert response.status_code == 403 and "192.168.1.5" in response.json()["error"]["message"]


def test_refusal_uses_the_address_the_request_reached() -> None:
    def scope(server: tuple[str, int] | None, host: bytes, origin: bytes | None = None) -> dict:
        headers = [(b"host", host)] + ([(b"origin", origin)] if origin else [])
        return {"type": "http", "server": server, "headers": headers}

    assert refusal(scope(("127.0.0.1", 8000), b"127.0.0.1:8000")) is None
    assert refusal(scope(("::1", 8000), b"[::1]:8000", b"http://[::1]:8000")) is None
    assert refusal(scope(None, b"localhost")) is None  # a UNIX socket
    assert "10.0.0.7" in refusal(scope(("10.0.0.7", 8000), b"127.0.0.1:8000"))
    assert "Host" in refusal(scope(("127.0.0.1", 8000), b"127.0.0.1.nip.io:8000"))


def test_metrics_token_and_model_labels(tmp_path: Path, sqlite_url: str) -> None:
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.jobs import submit_job

    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, metrics_token="s3cret")
    model_dir = tmp_path / "models" / "my-model"
    model_dir.mkdir(parents=True)
    with session_factory(sqlite_url)() as session:
        submit_job(session, settings=settings, stream=io.BytesIO(GOOD), model=str(model_dir))
        submit_job(session, settings=settings, stream=io.BytesIO(GOOD), model="tenant-text-\u00e9-1")
        submit_job(session, settings=settings, stream=io.BytesIO(GOOD), model=TEST_MODEL)
    with TestClient(create_app(settings)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        response = client.get("/metrics", headers={"Authorization": "Bearer s3cret"})
    assert response.status_code == 200
    # Tenant-chosen models share one bounded label; known models (default, served, allowed) keep theirs.
    assert 'batchinfer:queue_depth{model="other"} 2.0' in response.text
    assert f'batchinfer:queue_depth{{model="{TEST_MODEL}"}} 1.0' in response.text
    assert str(tmp_path) not in response.text and "my-model" not in response.text
    assert "tenant-text" not in response.text
    with TestClient(create_app(make_settings(tmp_path, sqlite_url))) as client:  # no token: aggregated
        open_scrape = client.get("/metrics").text
    assert 'batchinfer:queue_depth{model="all"} 3.0' in open_scrape
    assert TEST_MODEL not in open_scrape and 'model="other"' not in open_scrape


def _app_client(tmp_path: Path, sqlite_url: str, **overrides: object) -> tuple[TestClient, dict[str, str]]:
    from batchinfer.store.apikeys import create_key
    from batchinfer.store.db import session_factory, upgrade

    upgrade(sqlite_url)
    client = TestClient(create_app(make_settings(tmp_path, sqlite_url, **overrides)))
    with session_factory(sqlite_url)() as session:
        key, _ = create_key(session, name="alice")
    return client, {"Authorization": f"Bearer {key}"}


def test_quotas_answer_429_naming_the_limit(tmp_path: Path, sqlite_url: str) -> None:
    client, auth = _app_client(tmp_path, sqlite_url, max_owner_active_jobs=1,
                               max_owner_stored_bytes=len(GOOD) * 2)
    with client:
        upload = lambda: client.post("/v1/files", headers=auth, data={"purpose": "batch"},  # noqa: E731
                                     files={"file": ("in.jsonl", GOOD)})
        file_id = upload().json()["id"]
        second = upload()
        assert second.status_code == 200
        response = upload()  # a third copy passes the stored-bytes limit
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert "max_owner_stored_bytes" in response.json()["error"]["message"]
        create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        response = client.post("/v1/batches", headers=auth, json=create)  # its request rows need room too
        assert response.status_code == 429 and "max_owner_stored_bytes" in response.json()["error"]["message"]
        assert client.delete(f"/v1/files/{second.json()['id']}", headers=auth).status_code == 200
        assert client.post("/v1/batches", headers=auth, json=create).status_code == 200
        assert upload().status_code == 429  # the batch's copy of the file counts like the file
        response = client.post("/v1/batches", headers=auth, json=create)
        assert response.status_code == 429 and "max_owner_active_jobs" in response.json()["error"]["message"]


def test_expires_after_of_files_and_batch_outputs(tmp_path: Path, sqlite_url: str) -> None:
    from batchinfer.store.db import session_factory
    from batchinfer.store.models import Job

    client, auth = _app_client(tmp_path, sqlite_url)
    with client:
        response = client.post("/v1/files", headers=auth, files={"file": ("in.jsonl", GOOD)},
                               data={"purpose": "batch", "expires_after[anchor]": "created_at",
                                     "expires_after[seconds]": "7200"})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["expires_at"] == body["created_at"] + 7200
        for seconds in ("60", "many"):
            bad = client.post("/v1/files", headers=auth, files={"file": ("in.jsonl", GOOD)},
                              data={"purpose": "batch", "expires_after[anchor]": "created_at",
                                    "expires_after[seconds]": seconds})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "expires_after.seconds"
        create = {"input_file_id": body["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
                  "output_expires_after": {"anchor": "created_at", "seconds": 3600}}
        batch = client.post("/v1/batches", headers=auth, json=create)
        assert batch.status_code == 200, batch.text
        create["output_expires_after"] = {"anchor": "created_at", "seconds": 10}
        assert client.post("/v1/batches", headers=auth, json=create).status_code == 400
    with session_factory(sqlite_url)() as session:
        assert session.get(Job, int(batch.json()["id"].removeprefix("batch_"))).output_expires_after == 3600
