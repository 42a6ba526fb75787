"""max_total_tokens through the REST API (issue 32): refused when not a positive integer, enforced while
the batch runs: 5 tokens a line and a budget of 22 record 4 lines, the other 6 end with budget_exceeded."""

from __future__ import annotations

from tests.api.conftest import TEST_MODEL
from tests.api.helpers import FixedOutputWorker, chat_line, jsonl
from tests.api.test_batches import create, lines_of, upload, wait_status


def test_a_budget_stops_the_batch_past_it_and_keeps_finished_lines(client, auth, factory):
    file_id = upload(client, auth, jsonl([chat_line(f"q{i}", f"question {i}") for i in range(10)]))
    batch = create(client, auth, file_id, max_total_tokens=22)
    with FixedOutputWorker(factory, model=TEST_MODEL):  # 3 prompt + 2 completion tokens a line
        done = wait_status(client, auth, batch["id"], {"completed", "failed"})
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 10, "completed": 4, "failed": 6}
    assert done["usage"]["total_tokens"] == 20 and done["max_total_tokens"] == 22
    output = lines_of(client, auth, done["output_file_id"])
    assert len(output) == 4 and all(line["error"] is None for line in output)  # run in prefix order
    errors = lines_of(client, auth, done["error_file_id"])
    assert {line["error"]["code"] for line in errors} == {"budget_exceeded"}
    assert "max_total_tokens=22" in errors[0]["error"]["message"]


def test_a_budget_below_one_is_refused_naming_the_field(client, auth):
    file_id = upload(client, auth, jsonl([chat_line("q", "question")]))
    response = client.post("/v1/batches", headers=auth, json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
        "max_total_tokens": 0})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "max_total_tokens"
