"""Property-based: schemathesis generates requests from the app's own OpenAPI spec (ASGI, in process);
no generated request, valid or not, may produce a 5xx. Bounded: a few dozen examples per operation.

The operations are driven with hypothesis directly (`operation.as_strategy()`): schemathesis' pytest
fixture loader reads a private pytest attribute that pytest 9 no longer has.
"""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error

from batchinfer.api.app import create_app
from batchinfer.store.apikeys import create_key
from batchinfer.store.db import session_factory
from tests.api.helpers import chat_line, jsonl

MAX_EXAMPLES = 30
OPERATIONS = [
    ("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/{file_id}"),
    ("DELETE", "/v1/files/{file_id}"), ("GET", "/v1/files/{file_id}/content"),
    ("POST", "/v1/batches"), ("GET", "/v1/batches"), ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"), ("POST", "/v1/batches/{batch_id}/retry"),
    ("POST", "/v1/batches/estimate"), ("GET", "/healthz"),
    ("GET", "/readyz"),
]


@pytest.fixture
def seeded_schema(api_settings):
    """(schema, key): the app's schema over a database holding a key, file-1 and batch_1 of its owner
    (the ids the spec's examples name, so the explicit phase reaches existing objects)."""
    app = create_app(api_settings)
    with session_factory(api_settings.effective_database_url)() as session:
        key, _ = create_key(session, name="fuzz")
    with TestClient(app) as client:
        headers = {"Authorization": f"Bearer {key}"}
        file_id = client.post("/v1/files", headers=headers, data={"purpose": "batch"},
                              files={"file": ("in.jsonl", jsonl([chat_line("a", "hi")]))}).json()["id"]
        client.post("/v1/batches", headers=headers, json={"input_file_id": file_id,
                                                          "endpoint": "/v1/chat/completions",
                                                          "completion_window": "24h"})
    return schemathesis.openapi.from_asgi("/openapi.json", app), key


def test_the_spec_lists_every_operation(seeded_schema):
    schema, _ = seeded_schema
    labels = {f"{op.ok().method.upper()} {op.ok().path}" for op in schema.get_all_operations()}
    assert labels == {f"{method} {path}" for method, path in OPERATIONS}


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_generated_request_causes_a_server_error(seeded_schema, method, path):
    schema, key = seeded_schema
    operation = schema[path][method]
    with_key = {"Authorization": f"Bearer {key}"}

    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def run(case) -> None:
        # The valid key replaces the generated one, so cases reach the handlers (test_auth covers bad keys).
        case.call_and_validate(headers=with_key, checks=[not_a_server_error])

    run()
