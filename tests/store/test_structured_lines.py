"""Structured-output fields on input lines: checked at ingest (a bad schema or regex is that line's error,
numbered and naming the field), stored with the params, rehydrated by the worker, run end to end; the
same fields through the REST API and as schedule defaults (--param)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import click
import jsonschema
import orjson
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from batchinfer.store import shards
from batchinfer.store.models import Request, RequestStatus, Shard
from batchinfer.wire.input_line import check_sampling_fields, parse_line
from batchinfer.wire.request import LineError
from tests.store.helpers import submit_job

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
USER = [{"role": "user", "content": "classify: win a prize now"}]


def chat(custom_id: str, **fields: object) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": USER, **fields}})


def completion(custom_id: str, **fields: object) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                         "body": {"model": "m", "prompt": "The answer is", **fields}})


def json_schema(schema: object, **extra: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, **extra}}


# (line, None if valid else (code, fragment of the message))
LINES: list[tuple[bytes, tuple[str, str] | None]] = [
    (chat("rf-schema", response_format=json_schema(SCHEMA, strict=True)), None),
    (chat("rf-object", response_format={"type": "json_object"}), None),
    (chat("rf-text", response_format={"type": "text"}), None),
    (chat("guided-json-text", guided_json=json.dumps(SCHEMA)), None),
    (completion("guided-regex", guided_regex=r"\d{4}-\d{2}-\d{2}"), None),
    (completion("guided-choice", guided_choice=["yes", "no"]), None),
    (completion("guided-grammar", guided_grammar='root ::= "a" | "b"'), None),
    (completion("so-json", structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}), None),
    (chat("bad-type", response_format=json_schema({"type": "strng"})),
     ("invalid_value", "body.response_format.json_schema.schema: #/type must be one of")),
    (chat("unsupported", response_format=json_schema({"type": "array", "uniqueItems": True})),
     ("invalid_value", "unsupported keyword 'uniqueItems' at #")),
    (chat("typo", guided_json={"type": "object", "properties": {"a": {"type": "integer", "minimun": 0}}}),
     ("invalid_value", "body.guided_json: unknown keyword 'minimun' at #/properties/a")),
    (completion("bad-regex", guided_regex="(ab"),
     ("invalid_value", "body.guided_regex: Regex parsing error")),
    (completion("lookahead", structured_outputs={"regex": "a(?=b)"}),
     ("invalid_value", "body.structured_outputs.regex: Regex parsing error")),
    (completion("bad-grammar", guided_grammar="root ::= nothing"),
     ("invalid_value", 'body.guided_grammar: EBNF parser error')),
    (completion("empty-choice", guided_choice=[]),
     ("invalid_value", "body.guided_choice: must be a non-empty")),
    (chat("two", response_format={"type": "json_object"}, guided_regex="a+"),
     ("invalid_value", "give one output constraint per request")),
    (chat("no-name", response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
     ("invalid_value", "body.response_format.json_schema.name: must be 1 to 64 letters, digits, _ or -; "
                       "it is missing")),
    (chat("no-schema", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     ("invalid_value", "body.response_format.json_schema.schema: missing")),
    (chat("xml", response_format={"type": "xml"}), ("invalid_value", "body.response_format.type: must be")),
    (completion("rf-on-completions", response_format={"type": "json_object"}),
     ("invalid_value", "body.response_format: belongs to /v1/chat/completions")),
    (chat("eos", guided_choice=["a"], ignore_eos=True),
     ("invalid_value", "body.ignore_eos: cannot be combined")),
    (b'{"prompt": "x", "guided_json": {"type": "object"}}', None),  # the shorthand form
    (b'{"prompt": "x", "guided_json": {"not": {}}}',
     ("invalid_value", "guided_json: unsupported keyword 'not'")),
]


def test_structured_lines_are_checked_at_ingest_and_stored_for_the_worker(session) -> None:
    content = b"".join(line + b"\n" for line, _ in LINES)
    job = submit_job(session, model="m", stream=io.BytesIO(content))
    rows = {r.line_number: r for r in session.scalars(select(Request).where(Request.job_id == job.id))}
    assert sorted(rows) == list(range(1, len(LINES) + 1))
    for number, (_, expected) in enumerate(LINES, start=1):
        row = rows[number]
        if expected is None:
            assert row.status == RequestStatus.PENDING, (number, row.error_message)
            continue
        code, fragment = expected
        assert row.status == RequestStatus.ERRORED, number
        assert row.error_code == code, (number, row.error_message)
        assert row.error_message.startswith(f"line {number}: ") and fragment in row.error_message, (
            number, row.error_message)
        assert "/project/cpp" not in row.error_message
    shard_ids = session.scalars(select(Shard.id).where(Shard.job_id == job.id)).all()
    pending = {r.line_number: r for shard_id in shard_ids
               for r in shards.pending_requests(session, shard_id=shard_id)}
    assert len(pending) == sum(expected is None for _, expected in LINES)
    for number, request in pending.items():
        assert request.params == parse_line(LINES[number - 1][0], number).params  # survived the database
    by_id = {r.custom_id: r.params.structured_outputs for r in pending.values()}
    assert by_id["rf-schema"].json == SCHEMA and by_id["guided-json-text"].json == SCHEMA
    assert by_id["rf-object"].json_object and by_id["rf-text"] is None
    assert by_id["guided-choice"].choice == ["yes", "no"] and by_id["so-json"].disable_any_whitespace
    assert by_id["rf-schema"].cache_key == by_id["guided-json-text"].cache_key  # compiled once


def test_a_structured_job_runs_end_to_end_and_content_is_the_json(sqlite_url, tiny_llama, tmp_path) -> None:
    from batchinfer.config import Settings
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.export import export_results
    from batchinfer.store.jobs import get_job
    from batchinfer.store.jobs import submit_job as submit
    from workers.process import make_runner, run_job

    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, write_batch_size=4)
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    lines = [chat(f"s{i}", temperature=1.0, seed=i, max_tokens=200, n=2 if i % 4 == 0 else 1,
                  structured_outputs=compact) for i in range(8)]
    lines += [chat(f"c{i}", seed=i, max_tokens=20, guided_choice=["spam", "ham"]) for i in range(4)]
    lines += [chat("free", temperature=0.0, max_tokens=5)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        job = submit(session, settings=settings, path=path, model=str(tiny_llama), owner="t", shard_size=5)
    runner = make_runner(model=str(tiny_llama), settings=settings, max_num_seqs=8, device="cpu")
    run_job(job_id=job.id, runner=runner)
    with sessions() as session:
        assert get_job(session, job_id=job.id).request_counts == {"total": 13, "completed": 13, "failed": 0}
        out = [orjson.loads(line) for line in export_results(session, job_id=job.id)]
    runner.engine.close()
    for line in out:
        choices = line["response"]["body"]["choices"]
        contents = [choice["message"]["content"] for choice in choices]
        if line["custom_id"].startswith("s"):
            assert len(choices) == (2 if line["custom_id"] in ("s0", "s4") else 1)
            for choice, content in zip(choices, contents, strict=True):
                assert choice["finish_reason"] == "stop"
                jsonschema.validate(json.loads(content), SCHEMA)  # OpenAI's shape: the JSON text
        elif line["custom_id"].startswith("c"):
            assert contents[0] in ("spam", "ham")


def test_the_rest_api_passes_structured_bodies_through(tmp_path: Path, sqlite_url: str) -> None:
    from batchinfer.api.app import create_app
    from batchinfer.store.apikeys import create_key
    from batchinfer.store.db import session_factory, upgrade
    from tests.api.conftest import make_settings

    upgrade(sqlite_url)
    with session_factory(sqlite_url)() as session:
        key, _ = create_key(session, name="alice")
    auth = {"Authorization": f"Bearer {key}"}
    content = chat("ok", response_format=json_schema(SCHEMA)) + b"\n" + chat(
        "bad", response_format=json_schema({"type": "object", "properties": {"a": {"not": {}}}})) + b"\n"
    with TestClient(create_app(make_settings(tmp_path, sqlite_url))) as client:
        uploaded = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                               files={"file": ("in.jsonl", content, "application/jsonl")})
        assert uploaded.status_code == 200, uploaded.text
        batch = client.post("/v1/batches", headers=auth, json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["request_counts"]["failed"] == 1 and body["request_counts"]["total"] == 2
    [error] = body["errors"]["data"]
    assert error["line"] == 2 and error["param"] == "body.response_format.json_schema.schema"
    assert "unsupported keyword 'not' at #/properties/a" in error["message"]


def test_schedule_defaults_use_the_same_validator() -> None:
    from batchinfer.cli.schedule_cmd import _params  # what `batchinfer schedule add --param` runs

    json_object = {"response_format": {"type": "json_object"}}
    assert _params(('response_format={"type": "json_object"}',)) == json_object
    assert _params(('guided_choice=["a", "b"]',)) == {"guided_choice": ["a", "b"]}
    check_sampling_fields({"structured_outputs": {"regex": "[0-9]+"}})
    with pytest.raises(click.BadParameter, match="guided_regex: Regex parsing error"):
        _params(("guided_regex=(ab",))
    with pytest.raises(LineError, match="unknown keyword 'minimun'") as caught:
        check_sampling_fields({"guided_json": {"type": "integer", "minimun": 0}})
    assert caught.value.param == "guided_json"
