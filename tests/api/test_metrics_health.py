"""/metrics (process registry + DB job metrics + API latency), health probes, error shapes."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.api.app import create_app
from tests.api.conftest import TEST_MODEL, make_settings
from tests.api.helpers import FixedOutputWorker, chat_line, jsonl


def scrape(client: TestClient) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_report_jobs_requests_queue_rates_and_latency(client, auth, factory):
    before = scrape(client)
    content = jsonl([chat_line(f"q{i}", "hi") for i in range(10)] + [b'{"custom_id": "bad"}'])
    file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                          files={"file": ("in.jsonl", content)}).json()["id"]
    batch = client.post("/v1/batches", headers=auth, json={"input_file_id": file_id, "endpoint":
                                                           "/v1/chat/completions"}).json()
    client.get(f"/v1/batches/{batch['id']}", headers=auth)
    client.get("/no/such/route/12345")

    during = scrape(client)
    assert value(during, "batchinfer:jobs", status="in_progress") == 1
    assert value(during, "batchinfer:jobs", status="completed") == 0
    assert value(during, "batchinfer:job_requests", status="pending") == 10
    assert value(during, "batchinfer:job_requests", status="errored") == 1
    assert value(during, "batchinfer:queue_depth", model="all") == 3  # 10 valid requests, shard_size 4
    uploaded = "batchinfer:api_uploaded_bytes_total"
    assert value(during, uploaded) - value(before, uploaded) == len(content)
    ingested = "batchinfer:api_ingested_requests_total"
    assert value(during, ingested) - value(before, ingested) == 11
    polls = ("batchinfer:api_request_duration_seconds_count", "GET", "/v1/batches/{batch_id}", "200")
    assert value(during, polls[0], method=polls[1], route=polls[2], status=polls[3]) >= 1
    assert value(during, polls[0], method="GET", route="unmatched", status="404") >= 1
    assert not any("12345" in str(labels) for _, labels in during)  # raw paths never become labels

    with FixedOutputWorker(factory, model=TEST_MODEL):
        deadline = time.monotonic() + 30
        while client.get(f"/v1/batches/{batch['id']}", headers=auth).json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
    done = client.get(f"/v1/batches/{batch['id']}", headers=auth).json()
    exported = client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth).content
    after = scrape(client)
    assert value(after, "batchinfer:jobs", status="completed") == 1
    assert value(after, "batchinfer:job_requests", status="succeeded") == 10
    assert value(after, "batchinfer:job_requests", status="pending") == 0
    assert value(after, "batchinfer:queue_depth", model="all") == 0  # no metrics_token: aggregated
    lines = "batchinfer:api_exported_lines_total"
    assert value(after, lines, kind="output") - value(before, lines, kind="output") == 10
    size = "batchinfer:api_exported_bytes_total"
    assert value(after, size, kind="output") - value(before, size, kind="output") == len(exported)


def test_health_probes(client, tmp_path):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok", "database": "ok"}
    down = create_app(make_settings(tmp_path, "postgresql+psycopg://postgres@127.0.0.1:1/nothing"))
    with TestClient(down) as down_client:
        response = down_client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "database": "unreachable"}


def test_unexpected_errors_are_500_without_internals(app, auth):
    def boom() -> None:
        raise RuntimeError("password=hunter2 at /srv/secret/path.py")

    app.add_api_route("/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert "hunter2" not in response.text and "secret" not in response.text


def test_framework_errors_use_the_openai_shape(client, auth):
    not_found = client.get("/v2/whatever", headers=auth)
    assert not_found.status_code == 404
    assert set(not_found.json()["error"]) == {"message", "type", "param", "code"}
    wrong_method = client.put("/v1/batches", headers=auth)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    bad_query = client.get("/v1/batches", headers=auth, params={"limit": "many"})
    assert bad_query.status_code == 400
    assert bad_query.json()["error"]["param"] == "limit" and "limit" in bad_query.json()["error"]["message"]


def test_docs_and_openapi_are_served(client):
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert "/v1/batches/{batch_id}/cancel" in spec["paths"]
    upload = spec["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert "multipart/form-data" in upload
