"""/v1/files: streamed uploads and their 4xx answers, list, retrieve, content, delete."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from batchinfer.config import Settings
from tests.api.helpers import chat_line, jsonl

GOOD = jsonl([chat_line("a", "hello"), chat_line("b", "world")])


def upload(client: TestClient, auth: dict[str, str], content: bytes, *, purpose: str | None = "batch",
           filename: str = "in.jsonl"):
    data = {"purpose": purpose} if purpose is not None else {}
    return client.post("/v1/files", headers=auth, data=data,
                       files={"file": (filename, content, "application/jsonl")})


def assert_error(response, status: int, *, param: str | None = None, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert says.lower() in error["message"].lower(), error["message"]
    return error


def test_upload_returns_openai_file_object_and_stores_the_bytes(client, auth, api_settings: Settings):
    response = upload(client, auth, GOOD, filename="prompts.jsonl")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("file-") and body["object"] == "file"
    assert body["bytes"] == len(GOOD) and body["filename"] == "prompts.jsonl" and body["purpose"] == "batch"
    assert body["status"] == "processed" and isinstance(body["created_at"], int)
    stored = list((Path(api_settings.data_dir) / "files").iterdir())
    assert [p.name for p in stored] == [f"{body['id']}.jsonl"]  # renamed, no temp file left
    assert stored[0].read_bytes() == GOOD

    assert client.get(f"/v1/files/{body['id']}", headers=auth).json() == body
    content = client.get(f"/v1/files/{body['id']}/content", headers=auth)
    assert content.status_code == 200 and content.content == GOOD


def test_upload_streams_a_file_larger_than_one_write(client, auth, api_settings: Settings):
    big = jsonl([chat_line(f"id-{i}", "x" * 200) for i in range(3000)])  # ~750 KiB: several chunks and writes
    assert len(big) < api_settings.max_upload_bytes
    response = upload(client, auth, big)
    assert response.status_code == 200, response.text
    assert client.get(f"/v1/files/{response.json()['id']}/content", headers=auth).content == big


def test_too_large_upload_is_413_and_leaves_nothing(client, auth, api_settings: Settings):
    content = jsonl([chat_line(f"id-{i}", "y" * 500) for i in range(3000)])  # > 1 MiB limit
    assert len(content) > api_settings.max_upload_bytes
    error = assert_error(upload(client, auth, content), 413, param="file", says="too large")
    assert error["code"] == "file_too_large" and str(api_settings.max_upload_bytes) in error["message"]
    assert list((Path(api_settings.data_dir) / "files").iterdir()) == []


def test_not_jsonl_is_400_naming_line_1(client, auth):
    assert_error(upload(client, auth, b"id,prompt\n1,hello\n"), 400, param="file", says="line 1")
    assert_error(upload(client, auth, b'[{"custom_id": "a"}]\n'), 400, param="file", says="not an object")
    assert_error(upload(client, auth, b'{\n  "custom_id": "a"\n}\n'), 400, param="file",
                 says="not valid JSON")
    assert_error(upload(client, auth, b"\x00\x01\x02binary"), 400, param="file", says="not JSONL")


def test_empty_upload_is_400(client, auth):
    assert_error(upload(client, auth, b""), 400, param="file", says="empty")
    assert_error(upload(client, auth, b"\n \n\r\n"), 400, param="file", says="empty")


def test_wrong_or_missing_purpose_is_400(client, auth):
    assert_error(upload(client, auth, GOOD, purpose="fine-tune"), 400, param="purpose", says="only 'batch'")
    assert_error(upload(client, auth, GOOD, purpose=None), 400, param="purpose", says="purpose")


def test_missing_file_or_not_multipart_is_400(client, auth):
    assert_error(client.post("/v1/files", headers=auth, data={"purpose": "batch"}), 400, param="file")
    response = client.post("/v1/files", headers=auth, json={"purpose": "batch", "file": "x"})
    assert_error(response, 400, says="multipart/form-data")


def test_list_is_newest_first_paginated_and_owner_only(client, auth, make_key):
    ids = [upload(client, auth, GOOD).json()["id"] for _ in range(3)]
    other_key, _ = make_key("bob")
    upload(client, {"Authorization": f"Bearer {other_key}"}, GOOD)
    listing = client.get("/v1/files", headers=auth).json()
    assert listing["object"] == "list" and [f["id"] for f in listing["data"]] == ids[::-1]
    page = client.get("/v1/files", headers=auth, params={"limit": 2}).json()
    assert [f["id"] for f in page["data"]] == ids[:0:-1] and page["has_more"] is True
    rest = client.get("/v1/files", headers=auth, params={"limit": 2, "after": page["last_id"]}).json()
    assert [f["id"] for f in rest["data"]] == ids[:1] and rest["has_more"] is False
    assert_error(client.get("/v1/files", headers=auth, params={"after": "nope"}), 400, param="after")


def test_delete_removes_row_and_bytes(client, auth, api_settings: Settings):
    file_id = upload(client, auth, GOOD).json()["id"]
    response = client.delete(f"/v1/files/{file_id}", headers=auth)
    assert response.json() == {"id": file_id, "object": "file", "deleted": True}
    assert list((Path(api_settings.data_dir) / "files").iterdir()) == []
    assert_error(client.get(f"/v1/files/{file_id}", headers=auth), 404, says=file_id)
    assert_error(client.delete(f"/v1/files/{file_id}", headers=auth), 404)


def test_unknown_file_ids_are_404(client, auth):
    for file_id in ("file-999", "file-out-999", "file-err-1", "not-an-id", "file-0"):
        assert_error(client.get(f"/v1/files/{file_id}", headers=auth), 404, says="no such file")
        assert_error(client.get(f"/v1/files/{file_id}/content", headers=auth), 404)
