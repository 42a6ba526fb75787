"""Requests carrying values no column can take get a 4xx naming the field, on SQLite and PostgreSQL alike:
ids past the column's range are 404 on every route, a NUL in a filename or model and an oversized
completion_window are 400, a multipart body cut off before its closing boundary is 400 with nothing
stored; and a batch no live worker can run says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from batchinfer.api.app import create_app
from batchinfer.store.db import get_engine, upgrade
from batchinfer.store.ids import INT32_MAX
from tests.api.conftest import make_settings
from tests.api.helpers import chat_line, jsonl

GOOD = jsonl([chat_line("a", "hello"), chat_line("b", "world")])
BIG_IDS = [str(INT32_MAX + 1), str(2**40), str(2**63), "9" * 18]


@pytest.fixture(params=["sqlite", "postgres"])
def hostile_client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    """A client of an app (auth disabled) on a fresh SQLite or PostgreSQL database."""
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    upgrade(url)
    app = create_app(make_settings(tmp_path, url, auth_disabled=True))
    try:
        with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
            yield client
    finally:
        get_engine(url).dispose()


def error_of(response, status: int, *, param: str | None, says: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says.lower() in error["message"].lower(), error
    return error


def upload(client: TestClient, content: bytes = GOOD, filename: str = "in.jsonl"):
    return client.post("/v1/files", data={"purpose": "batch"},
                       files={"file": (filename, content, "application/jsonl")})


def create(client: TestClient, **body: object):
    return client.post("/v1/batches", json={"endpoint": "/v1/chat/completions", **body})


def stored_files(client: TestClient) -> list[Path]:
    return sorted((Path(client.app.state.settings.data_dir) / "files").glob("*"))


@pytest.mark.parametrize("number", BIG_IDS)
def test_an_id_beyond_the_column_is_404_on_every_route(hostile_client: TestClient, number: str):
    client = hostile_client
    file_id = upload(client).json()["id"]
    assert create(client, input_file_id=file_id).status_code == 200  # a row exists: lookups really run
    batch, file = f"batch_{number}", f"file-{number}"
    error_of(client.get(f"/v1/batches/{batch}"), 404, param="batch_id", says="No such batch")
    error_of(client.post(f"/v1/batches/{batch}/cancel"), 404, param="batch_id", says="No such batch")
    for route in (file, f"file-out-{number}", f"file-err-{number}"):
        error_of(client.get(f"/v1/files/{route}"), 404, param="file_id", says="No such File")
        error_of(client.get(f"/v1/files/{route}/content"), 404, param="file_id", says="No such File")
        error_of(client.delete(f"/v1/files/{route}"), 404, param="file_id", says="No such File")
    error_of(create(client, input_file_id=file), 404, param="input_file_id", says="No such File")
    for listing in (f"/v1/batches?after={batch}", f"/v1/files?after={file}"):
        assert client.get(listing).status_code in (200, 400)  # a cursor past every id: a page, or "invalid"


@pytest.mark.parametrize("batch_id", ["batch_-1", "batch_0", "batch_1.5", "batch_١"])
def test_a_negative_or_malformed_id_is_404(hostile_client: TestClient, batch_id: str):
    error_of(hostile_client.get(f"/v1/batches/{batch_id}"), 404, param="batch_id", says="No such batch")


def test_a_nul_in_the_filename_is_400_and_nothing_is_stored(hostile_client: TestClient):
    body, headers = multipart(GOOD, close=True, filename="in\x00.jsonl")  # raw: httpx would send %00
    error_of(hostile_client.post("/v1/files", content=body, headers=headers), 400, param="file",
             says="NUL character")
    assert stored_files(hostile_client) == []
    assert hostile_client.get("/v1/files").json()["data"] == []


def test_a_nul_in_the_model_is_400(hostile_client: TestClient):
    file_id = upload(hostile_client).json()["id"]
    error = error_of(create(hostile_client, input_file_id=file_id, model="m\x00"), 400, param="model",
                     says="NUL character")
    assert error["code"] == "invalid_value"
    assert hostile_client.get("/v1/batches").json()["data"] == []


@pytest.mark.parametrize("window", ["99999999d", "31d", "2592001s"])
def test_a_window_beyond_the_maximum_is_400_naming_the_field_and_the_limit(hostile_client: TestClient,
                                                                          window: str):
    file_id = upload(hostile_client).json()["id"]
    error_of(create(hostile_client, input_file_id=file_id, completion_window=window), 400,
             param="completion_window", says="longer than the maximum of 30d")
    assert hostile_client.get("/v1/batches").json()["data"] == []


def multipart(content: bytes, *, close: bool, filename: str = "in.jsonl") -> tuple[bytes, dict[str, str]]:
    boundary = "hostileboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode() + content
    if close:
        body += f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


@pytest.mark.parametrize("cut", [len(GOOD) // 2, len(GOOD), len(GOOD) + 5])
def test_a_body_cut_before_its_closing_boundary_is_400_and_nothing_is_stored(hostile_client: TestClient,
                                                                             cut: int):
    body, headers = multipart(GOOD, close=True)
    start = body.index(GOOD)
    response = hostile_client.post("/v1/files", content=body[:start + cut], headers=headers)
    error_of(response, 400, param="file", says="closing boundary")
    assert stored_files(hostile_client) == []
    assert hostile_client.get("/v1/files").json()["data"] == []
    whole = hostile_client.post("/v1/files", content=body, headers=headers)  # the same body, complete
    assert whole.status_code == 200, whole.text
    assert hostile_client.get(f"/v1/files/{whole.json()['id']}/content").content == GOOD


def test_a_batch_no_live_worker_serves_says_so(hostile_client: TestClient):
    file_id = upload(hostile_client).json()["id"]
    created = create(hostile_client, input_file_id=file_id, model="nobody-serves-this").json()
    assert created["status"] == "in_progress"
    for batch in (hostile_client.get(f"/v1/batches/{created['id']}").json(),
                  hostile_client.get("/v1/batches").json()["data"][0]):
        assert "no live worker serves model 'nobody-serves-this'" in batch["progress"]["note"], batch
