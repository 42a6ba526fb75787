"""POST /v1/batches/{id}/retry (issue 31): a child batch of a finished batch's failed / expired / cancelled
lines, the parent named in its metadata, invalid lines named and left out unless asked for; another
owner's batch is not found, a running one is refused."""

from __future__ import annotations

from tests.api.helpers import chat_line, jsonl


def _cancelled_batch(client, auth) -> str:
    content = jsonl([chat_line(f"q{i}", f"hi {i}") for i in range(5)] + [b'{"custom_id": "bad", "body": 3}'])
    file_id = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                          files={"file": ("in.jsonl", content)}).json()["id"]
    body = {"input_file_id": file_id, "metadata": {"team": "a"}, "endpoint": None}
    batch = client.post("/v1/batches", headers=auth, json=body).json()
    assert batch["status"] == "in_progress", batch
    refused = client.post(f"/v1/batches/{batch['id']}/retry", headers=auth, json={})
    assert refused.status_code == 400 and "retry it once it has ended" in refused.json()["error"]["message"]
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth).json()  # no worker: at once
    assert cancelled["status"] == "cancelled"
    return batch["id"]


def test_retry_makes_a_child_of_the_lines_that_did_not_succeed(client, auth, make_key) -> None:
    parent = _cancelled_batch(client, auth)
    child = client.post(f"/v1/batches/{parent}/retry", headers=auth, json={}).json()
    left_out = [{"line": 6, "code": "missing_required_parameter"}]  # named, not retried: it cannot succeed
    assert child["retry"] == {"of": parent, "lines": 5, "left_out": left_out}
    assert child["metadata"] == {"team": "a", "retry_of": parent}
    assert child["request_counts"]["total"] == 5 and child["status"] == "in_progress"

    only_failed = client.post(f"/v1/batches/{parent}/retry", headers=auth, json={"only": ["failed"]})
    assert only_failed.status_code == 400  # its one failed line is the invalid one, left out
    assert "include_invalid retries them" in only_failed.json()["error"]["message"]
    with_invalid = client.post(f"/v1/batches/{parent}/retry", headers=auth,
                               json={"only": ["failed"], "include_invalid": True}).json()
    assert with_invalid["retry"]["lines"] == 1  # and it fails again, as its input is still invalid
    assert with_invalid["status"] == "failed" and with_invalid["errors"]["data"], with_invalid

    bad_kind = client.post(f"/v1/batches/{parent}/retry", headers=auth, json={"only": ["broken"]})
    assert bad_kind.status_code == 400

    other, _ = make_key("bob")
    hidden = client.post(f"/v1/batches/{parent}/retry", headers={"Authorization": f"Bearer {other}"}, json={})
    assert hidden.status_code == 404
