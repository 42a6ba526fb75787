"""Issue 28 items 1, 2, 5: whatever a line holds (nesting past orjson's writer, huge or odd values, deep
schemas, long logits-control lists), it costs that line only: its own line-numbered error naming the
limit, and the rest of the file ingests. Through the real parse_line + RequestBudget + ingest_file."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from batchinfer.config import Settings
from batchinfer.store.db import get_engine, session_factory, upgrade
from batchinfer.store.ingest import IngestLimits
from batchinfer.store.models import JobStatus, Request, RequestStatus
from batchinfer.wire.budget import RequestBudget
from batchinfer.wire.input_line import parse_line
from batchinfer.wire.request import LineError, NormalizedRequest, encode_stored
from tests.store.helpers import submit_job

USER = [{"role": "user", "content": "hi"}]
BUDGET = RequestBudget.from_settings(Settings(), "not-a-local-model")


def _nested(depth: int, leaf: Any = 1, *, as_dict: bool = False) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value} if as_dict else [value]
    return value


def _line(custom_id: str, **body: Any) -> bytes:
    # json, not orjson: orjson refuses to write what these tests are about (> 254 levels)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": USER, **body}}).encode()


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEEP_LINES = {  # field -> a line nesting 300 levels there
    "unknown_field": _line("deep-unknown", unknown_field=_nested(300)),
    "chat_template_kwargs": _line("deep-kwargs", chat_template_kwargs={"x": _nested(300, as_dict=True)}),
    "guided_json": _line("deep-schema", guided_json=_nested(300, as_dict=True)),
    "metadata": _line("deep-metadata", metadata={"k": _nested(300)}),
    "messages[0].name": json.dumps({"custom_id": "deep-name", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"messages": [{"role": "user", "content": "hi",
                                                           "name": _nested(300)}]}}).encode(),
}


def test_a_300_level_line_is_its_own_error_and_the_rest_of_the_file_ingests(sqlite_db: str) -> None:
    lines = [_line("ok-1"), *DEEP_LINES.values(), _line("ok-2")]
    with session_factory(sqlite_db)() as session:
        job = submit_job(session, model="m", stream=io.BytesIO(b"\n".join(lines) + b"\n"))
        assert job.status == JobStatus.IN_PROGRESS, job.errors
        rows = {r.custom_id: r for r in session.scalars(select(Request).where(Request.job_id == job.id))}
    assert rows["ok-1"].status == rows["ok-2"].status == RequestStatus.PENDING
    errors = {e["line"]: e for e in job.errors}
    assert sorted(errors) == list(range(2, 2 + len(DEEP_LINES)))
    for number, error in errors.items():
        assert error["message"].startswith(f"line {number}: "), error
    assert "nests more than 254 levels" in errors[2]["message"] and errors[2]["param"] == "body.unknown_field"
    assert "chat_template_kwargs" in errors[3]["param"]


def test_deep_schemas_and_long_control_lists_are_line_errors_naming_the_setting(sqlite_db: str) -> None:
    lines = [
        _line("deep-250", guided_json=_nested_schema(250)),  # ~1 s of xgrammar conversion before
        _line("ok-65", guided_json=_nested_schema(20)),
        _line("bias", logit_bias={str(i): 1 for i in range(301)}),
        _line("allowed", allowed_token_ids=list(range(4097))),
        _line("words", bad_words=[f"w{i}" for i in range(1025)]),
        _line("ok-lists", logit_bias={str(i): 1 for i in range(300)}, bad_words=["x"] * 1024),
    ]
    with session_factory(sqlite_db)() as session:
        job = submit_job(session, model="m", stream=io.BytesIO(b"\n".join(lines) + b"\n"))
    messages = {e["line"]: e["message"] for e in job.errors}
    assert sorted(messages) == [1, 3, 4, 5], messages
    assert "max_constraint_depth" in messages[1] and "64 levels" in messages[1]
    assert "301 logit_bias entries; at most 300" in messages[3] and "(max_logit_bias)" in messages[3]
    assert "(max_allowed_token_ids)" in messages[4] and "(max_bad_words)" in messages[5]


def test_the_constraint_budget_comes_from_the_settings(sqlite_db: str) -> None:
    limits = IngestLimits.from_settings(Settings(max_constraint_depth=4, max_constraint_bytes=200,
                                                 grammar_compile_timeout_seconds=5), "m")
    lines = [_line("deep", guided_json=_nested_schema(5)),  # 6 JSON levels
             _line("big", guided_choice=["x" * 50] * 5),
             _line("big-regex", guided_regex="(" * 5 + "a" + ")" * 5),
             _line("ok", guided_choice=["yes", "no"])]
    with session_factory(sqlite_db)() as session:
        job = submit_job(session, model="m", stream=io.BytesIO(b"\n".join(lines) + b"\n"), limits=limits)
    messages = {e["line"]: e["message"] for e in job.errors}
    assert sorted(messages) == [1, 2, 3], messages
    assert "more than 4 levels deep (max_constraint_depth)" in messages[1]
    assert "at most 200 are allowed (max_constraint_bytes)" in messages[2]
    assert "max_constraint_depth" in messages[3]


# ------------------------------------------------------------------------------------- the fuzz

LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
          | st.floats(allow_nan=False) | st.text(max_size=30)
          | st.builds(lambda n, c: c * n, st.integers(0, 20_000), st.sampled_from(["a", "\u00e9", "\x00"])))
FIELDS = ["messages", "prompt", "max_tokens", "temperature", "n", "stop", "seed", "logit_bias",
          "bad_words", "allowed_token_ids", "guided_json", "guided_choice", "guided_regex", "guided_grammar",
          "response_format", "structured_outputs", "chat_template_kwargs", "metadata", "model", "echo",
          "logprobs", "top_logprobs", "unknown_field", "tools", "user"]


@st.composite
def _deep_value(draw: st.DrawFn) -> Any:
    """A value nested 0 to 320 levels (arrays or objects, mixed) around a leaf of any type or size."""
    value = draw(LEAVES)
    for kind in draw(st.lists(st.sampled_from(["list", "dict", "wide"]), max_size=320)):
        value = [value] if kind == "list" else {"k": value} if kind == "dict" else {"k": value, "w": [1] * 50}
    return value


BODIES = st.dictionaries(st.sampled_from(FIELDS), _deep_value() | LEAVES, max_size=4)
LINES = st.builds(lambda body, shorthand: json.dumps(body if shorthand else {
    "custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode(),
    st.builds(lambda b: {"messages": USER, **b}, BODIES) | BODIES, st.booleans())


def _parse(line: bytes) -> NormalizedRequest | LineError:
    try:
        request = parse_line(line, 3)
        BUDGET.check(request)
    except LineError as exc:
        assert exc.code and exc.message
        return exc
    encode_stored(request)
    return request


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(line=LINES)
def test_parse_line_answers_a_request_or_a_line_error_whatever_nesting_size_types(line: bytes) -> None:
    _parse(line)


@pytest.fixture(scope="module")
def fuzz_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.db'}"
    upgrade(url)
    yield url
    get_engine(url).dispose()


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(LINES, min_size=1, max_size=6))
def test_ingest_turns_every_line_into_a_row_and_never_fails_the_job(fuzz_db: str, lines: list[bytes]) -> None:
    good = b'{"prompt": "a good line"}'
    with session_factory(fuzz_db)() as session:
        job = submit_job(session, model="m", stream=io.BytesIO(b"\n".join([*lines, good]) + b"\n"))
        assert job.status == JobStatus.IN_PROGRESS, job.errors
        rows = session.scalars(select(Request).where(Request.job_id == job.id)).all()
    assert len(rows) == len(lines) + 1
    by_line = {row.line_number: row for row in rows}
    assert by_line[len(lines) + 1].status == RequestStatus.PENDING
    for number, line in enumerate(lines, start=1):
        expected = _parse(line)
        row = by_line[number]
        if isinstance(expected, LineError):
            assert row.status == RequestStatus.ERRORED and row.error_message.startswith(f"line {number}: ")


def test_a_constraint_converting_past_the_time_budget_is_its_lines_error(sqlite_db: str) -> None:
    limits = IngestLimits.from_settings(Settings(grammar_compile_timeout_seconds=0.001), "m")
    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(3000)]}
    lines = [_line("slow", guided_json=wide), _line("ok", guided_choice=["yes", "no"])]  # ~0.3 s; instant
    with session_factory(sqlite_db)() as session:
        job = submit_job(session, model="m", stream=io.BytesIO(b"\n".join(lines) + b"\n"), limits=limits)
    assert [e["line"] for e in job.errors] == [1]
    assert job.errors[0]["message"] == ("line 1: body.guided_json: converting the json constraint took "
                                        "longer than 0.001 s (grammar_compile_timeout_seconds); simplify it")
