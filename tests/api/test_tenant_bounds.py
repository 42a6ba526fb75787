"""One tenant must not hurt the rest (issue 28 items 9, 10, 12, 13): quotas that hold under concurrency and
count the database, uploads refused before their bytes land, known models only, stored result sizes,
no sign-in from another site. Each drives the real API (a uvicorn server, or the in-process client)."""

from __future__ import annotations

import http.client
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from select import select as readable

import httpx
import pytest
from sqlalchemy import select, update

from batchinfer.api.app import create_app
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.files import files_dir
from batchinfer.store.models import Job, OwnerUsage
from batchinfer.store.result_files import record_result_sizes
from batchinfer.store.workers import register_worker
from tests.api.conftest import TEST_MODEL, make_settings
from tests.api.helpers import FixedOutputWorker, chat_line, jsonl, key_maker, serve

TEN_LINES = jsonl([chat_line(f"q{i}", "hi") for i in range(10)])
CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    upgrade(url)
    return url


def _stored(url: str, owner: str) -> int:
    with session_factory(url)() as session:
        return session.scalar(select(OwnerUsage.stored_bytes).where(OwnerUsage.owner == owner)) or 0


def test_concurrent_creates_cannot_all_pass_the_pending_requests_quota(tmp_path: Path, db_url: str) -> None:
    settings = make_settings(tmp_path, db_url, max_owner_pending_requests=30, max_owner_active_jobs=None,
                             max_owner_stored_bytes=None)
    key, _ = key_maker(session_factory(db_url))("alice")
    auth = {"Authorization": f"Bearer {key}"}
    with serve(create_app(settings)) as url, httpx.Client(base_url=url, timeout=60) as client:
        file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                              files={"file": ("in.jsonl", TEN_LINES)}).json()["id"]

        def create(_: int) -> httpx.Response:
            return client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, **CREATE})

        with ThreadPoolExecutor(16) as pool:  # 16 creates at once, each of 10 requests, against 30
            answers = list(pool.map(create, range(16)))
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [200] * 3 + [429] * 13, [answer.text for answer in answers if answer.status_code >= 500]
    refused = next(answer for answer in answers if answer.status_code == 429).json()["error"]
    assert "max_owner_pending_requests" in refused["message"] and refused["type"] == "rate_limit_error"
    with session_factory(db_url)() as session:
        totals = session.scalars(select(Job.total_requests).where(Job.owner == "alice")).all()
    assert sorted(totals) == [10, 10, 10]  # never more waiting than the limit


def test_batches_made_from_one_upload_count_their_database_bytes(client, auth, api_settings, factory) -> None:
    limit = len(TEN_LINES) * 3 + len(TEN_LINES) // 2
    client.app.state.settings = api_settings.model_copy(update={"max_owner_stored_bytes": limit,
                                                                "max_owner_active_jobs": None})
    url = api_settings.effective_database_url
    file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                          files={"file": ("in.jsonl", TEN_LINES)}).json()["id"]
    first = client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, **CREATE})
    second = client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, **CREATE})
    assert first.status_code == second.status_code == 200
    assert _stored(url, "alice") == 3 * len(TEN_LINES)  # the upload and two copies of its requests
    again = client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, **CREATE})
    assert again.status_code == 429 and "max_owner_stored_bytes" in again.json()["error"]["message"]

    with FixedOutputWorker(factory, model=TEST_MODEL):  # results are stored bytes too, once the jobs end
        deadline = time.monotonic() + 30
        while {client.get(f"/v1/batches/{b}", headers=auth).json()["status"]
               for b in (first.json()["id"],)} != {"completed"}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    done = client.get(f"/v1/batches/{first.json()['id']}", headers=auth).json()
    listed = {f["id"]: f["bytes"] for f in client.get("/v1/files", headers=auth).json()["data"]}
    output_bytes = len(client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth).content)
    assert listed[done["output_file_id"]] == output_bytes
    assert _stored(url, "alice") >= 3 * len(TEN_LINES) + output_bytes
    before = _stored(url, "alice")
    assert client.delete(f"/v1/files/{done['output_file_id']}", headers=auth).status_code == 200
    # Deleting gives the bytes back: the output's, and, no row of the job being left (no error file), the
    # job's copy of its requests. Before, that copy stayed charged until the job's retention purge.
    assert _stored(url, "alice") == before - output_bytes - len(TEN_LINES)
    assert client.delete(f"/v1/files/{file_id}", headers=auth).status_code == 200
    assert _stored(url, "alice") == before - output_bytes - 2 * len(TEN_LINES)


def test_a_batch_that_fails_at_ingest_gives_its_bytes_back(client, auth, api_settings) -> None:
    bad = b'{"not": "a request"}\n' * 5
    file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                          files={"file": ("bad.jsonl", bad)}).json()["id"]
    assert _stored(api_settings.effective_database_url, "alice") == len(bad)
    batch = client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, **CREATE}).json()
    assert batch["status"] == "failed"
    assert _stored(api_settings.effective_database_url, "alice") == len(bad)  # only the upload stays


def test_listing_files_reads_the_sizes_stored_when_the_job_ended(client, auth, factory) -> None:
    file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                          files={"file": ("in.jsonl", TEN_LINES)}).json()["id"]
    batch = client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, **CREATE}).json()
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth).json()
    assert cancelled["status"] == "cancelled" and cancelled["error_file_id"]
    job_id = int(batch["id"].removeprefix("batch_"))
    deadline = time.monotonic() + 20  # the cancel that ended it measures its files in the background
    while True:
        with factory() as session:
            stored = session.scalar(select(Job.error_bytes).where(Job.id == job_id))
        if stored is not None:
            break
        assert time.monotonic() < deadline, "the cancel did not store the error file's size"
        time.sleep(0.02)
    content = client.get(f"/v1/files/{cancelled['error_file_id']}/content", headers=auth).content
    assert stored == len(content)
    with factory() as session:  # a listing reads the stored size: it never exports the file to size it
        session.execute(update(Job).where(Job.id == job_id).values(error_bytes=123_456_789))
        session.commit()
        assert record_result_sizes(session, job_id=job_id).error_bytes == 123_456_789  # measured once
    files = client.get("/v1/files", headers=auth, params={"purpose": "batch_output"}).json()["data"]
    assert [(f["id"], f["bytes"]) for f in files] == [(cancelled["error_file_id"], 123_456_789)]


def _raw_upload(url: str, key: str, *, length: int | None, first: bytes) -> http.client.HTTPConnection:
    """Start a multipart upload on a raw connection: headers and `first` bytes of the file, no more."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/files")
    conn.putheader("Authorization", f"Bearer {key}")
    conn.putheader("Content-Type", "multipart/form-data; boundary=XyZ")
    if length is not None:
        conn.putheader("Content-Length", str(length))
    else:
        conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    head = (b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XyZ\r\n'
            b'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n') + first
    conn.send(head if length is not None else b"%x\r\n%s\r\n" % (len(head), head))
    return conn


def test_uploads_are_refused_before_their_bytes_land(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, max_owner_stored_bytes=200_000, max_upload_bytes=1 << 30,
                             max_owner_concurrent_uploads=2)
    make = key_maker(session_factory(sqlite_url))
    alice, bob = make("alice")[0], make("bob")[0]
    staged = files_dir(settings.data_dir)
    line = chat_line("x", "y" * 900) + b"\n"
    app = create_app(settings)
    with serve(app) as url:
        # Announced past the quota: 429 before a byte of the body is read.
        conn = _raw_upload(url, alice, length=1 << 30, first=b"")
        response = conn.getresponse()
        assert response.status == 429 and b"max_owner_stored_bytes" in response.read()
        conn.close()
        # Streamed (no length): cut off as soon as the running total passes what is left.
        conn = _raw_upload(url, alice, length=None, first=line)
        chunk = line * 64
        sent = 0
        try:
            while sent < 10 << 20:  # a 10 MiB file the quota cannot hold; stop once the server answers
                if readable([conn.sock], [], [], 0.01)[0]:
                    break
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed while we were still sending
        response = conn.getresponse()
        assert response.status == 429 and b"max_owner_stored_bytes" in response.read()
        assert sent < 2 << 20, f"the server read {sent} bytes of an upload it could never keep"
        conn.close()
        assert not list(staged.glob(".upload-*"))  # nothing staged stays
        # Per owner, at most max_owner_concurrent_uploads stream at once.
        slow = [_raw_upload(url, alice, length=1 << 16, first=line) for _ in range(2)]
        deadline = time.monotonic() + 20
        while app.state.uploads_in_flight.get("alice", 0) < 2:  # both are streaming in the route now
            assert time.monotonic() < deadline
            time.sleep(0.01)
        third = httpx.post(f"{url}/v1/files", headers={"Authorization": f"Bearer {alice}"},
                           data={"purpose": "batch"}, files={"file": ("in.jsonl", TEN_LINES)}, timeout=30)
        assert third.status_code == 429 and "max_owner_concurrent_uploads" in third.json()["error"]["message"]
        other = httpx.post(f"{url}/v1/files", headers={"Authorization": f"Bearer {bob}"},
                           data={"purpose": "batch"}, files={"file": ("in.jsonl", TEN_LINES)}, timeout=30)
        assert other.status_code == 200  # another owner is not held up
        for conn in slow:
            conn.close()


def test_a_batch_names_a_known_model_and_metrics_never_take_tenant_text(tmp_path, sqlite_url) -> None:
    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, allowed_models=["allowed-extra"], metrics_token="t0k")
    factory = session_factory(sqlite_url)
    key, _ = key_maker(factory)("alice")
    auth = {"Authorization": f"Bearer {key}"}
    with factory() as session:
        register_worker(session, worker_id="w1", model="served-model")
    from fastapi.testclient import TestClient

    with TestClient(create_app(settings)) as client:
        file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                              files={"file": ("in.jsonl", TEN_LINES)}).json()["id"]
        for model in ("/etc/passwd", "../../secret-model", "tenant-model-1"):
            refused = client.post("/v1/batches", headers=auth,
                                  json={"input_file_id": file_id, "model": model, **CREATE})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert "served-model" in error["message"] and "allowed_models" in error["message"]
        for model in ("served-model", "allowed-extra", TEST_MODEL):
            accepted = client.post("/v1/batches", headers=auth,
                                   json={"input_file_id": file_id, "model": model, **CREATE})
            assert accepted.status_code == 200, accepted.text
        scrape = client.get("/metrics", headers={"Authorization": "Bearer t0k"}).text
    assert 'queue_depth{model="served-model"} 3.0' in scrape and "passwd" not in scrape


def test_sign_in_from_another_site_is_refused(client, make_key) -> None:
    key, _ = make_key("victim-of-login-csrf")
    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"},
                    {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                    {"Origin": "http://testserver.evil.example", "Sec-Fetch-Site": "same-origin"},
                    {"Referer": "https://evil.example/login-csrf.html"}):
        refused = client.post("/ui/login", data={"api_key": key}, headers=headers, follow_redirects=False)
        assert refused.status_code == 403, headers
        assert "another site" in refused.text and "set-cookie" not in refused.headers
    own = client.post("/ui/login", data={"api_key": key}, follow_redirects=False,
                      headers={"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"})
    assert own.status_code == 303 and "batchinfer_ui_key" in own.headers["set-cookie"]
