"""Errors name their field and input line as data (issue 30): the store's JobError, the REST answer's
`param`, the CLI's --json error object, and the dashboard's error rows, which read a failed request's line
from its row, never from its message text; a create checks each job field once, in the store."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api.ui.views import errors_preview
from batchinfer.store import jobs as job_store
from batchinfer.store.errors import JobError
from batchinfer.store.jobs import get_job
from batchinfer.store.models import Job, Request, RequestStatus
from batchinfer.store.serialize import parse_batch_id
from tests.api.helpers import chat_line, jsonl
from tests.cli.helpers import cli


def _upload(client: TestClient, auth: dict[str, str], content: bytes) -> str:
    response = client.post("/v1/files", headers=auth, files={"file": ("in.jsonl", content)},
                           data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _create(client: TestClient, auth: dict[str, str], **body: object):
    file_id = _upload(client, auth, jsonl([chat_line("a", "hi"), chat_line("b", "there")]))
    return client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, "endpoint": None,
                                                          "completion_window": "24h", **body})


def test_a_job_error_answers_its_field_as_param_and_its_line_in_the_message(app: FastAPI) -> None:
    @app.get("/test-job-error")
    def refuse() -> None:
        raise JobError("messages must not be empty", field="body.messages", line=7)

    with TestClient(app) as client:
        response = client.get("/test-job-error")
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "line 7: messages must not be empty",
                                         "type": "invalid_request_error", "param": "body.messages",
                                         "code": "invalid_value"}


@pytest.mark.parametrize(("body", "param"), [
    ({"completion_window": "soon"}, "completion_window"),
    ({"completion_window": "31d"}, "completion_window"),
    ({"endpoint": "/v1/moderations"}, "endpoint"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"model": "m" * 300}, "model"),
])
def test_the_store_names_the_field_a_create_refuses(client: TestClient, auth: dict[str, str],
                                                    body: dict[str, object], param: str) -> None:
    response = _create(client, auth, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert client.get("/v1/batches", headers=auth).json()["data"] == []  # refused before any job


def test_a_create_parses_its_completion_window_once(client: TestClient, auth: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    parse = job_store.parse_completion_window

    def counting(window: str) -> job_store.CompletionWindow:
        calls.append(window)
        return parse(window)

    monkeypatch.setattr(job_store, "parse_completion_window", counting)
    response = _create(client, auth, completion_window="0048h")
    assert response.status_code == 200, response.text
    assert response.json()["completion_window"] == "48h"  # stored canonical, from the one parse
    assert calls == ["0048h"]


def test_the_cli_error_names_the_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line("a", "hi")]))
    pairs = [arg for i in range(17) for arg in ("--metadata", f"k{i}=v")]
    code, output = cli("submit", str(path), "--model", "some-model", *pairs, "--json")
    assert code == 1
    error = orjson.loads(output.strip().splitlines()[-1])["error"]
    assert error["param"] == "metadata" and error["line"] is None, error


def test_the_dashboard_reads_a_failed_requests_line_from_its_row(client: TestClient, auth: dict[str, str],
                                                                  factory: sessionmaker[Session]) -> None:
    batch = _create(client, auth).json()
    job_id = parse_batch_id(batch["id"])
    assert job_id is not None
    with factory() as session, session.begin():  # a worker's error whose message names no line
        session.execute(update(Request).where(Request.job_id == job_id, Request.line_number == 2)
                        .values(status=RequestStatus.ERRORED, error_code="engine_error",
                                error_message="the engine refused it"))
        session.execute(update(Job).where(Job.id == job_id).values(failed_requests=1))
    with factory() as session:
        job = get_job(session, job_id=job_id)
        assert job is not None
        rows = errors_preview(session, job)
    assert [(row.where, row.code, row.message) for row in rows] == [
        ("line 2", "engine_error", "the engine refused it")]


def test_an_unusable_upload_names_its_line_as_data(tmp_path: Path) -> None:
    from batchinfer.store.files import InvalidFile, UploadWriter

    writer = UploadWriter(tmp_path, max_bytes=1000)
    with pytest.raises(InvalidFile) as refused:
        writer.write(b"[1, 2]\n")
    assert refused.value.line == 1
    with pytest.raises(InvalidFile) as empty:
        UploadWriter(tmp_path, max_bytes=1000).finish()
    assert empty.value.line is None  # the whole file, not one line
