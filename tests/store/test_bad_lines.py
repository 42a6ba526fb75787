"""A corpus of bad input lines: each gets its own line-numbered error, the valid lines still run.

The corpus is also checked in as tests/data/bad_lines.jsonl (regenerate it with
`python -m tests.store.test_bad_lines`). A prompt longer than the model's context is not here:
that needs the tokenizer, so the worker errors such requests (tests/workers).
"""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select

from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.store import shards
from batchinfer.store.export import export_results
from batchinfer.store.ingest import BOM, IngestLimits
from batchinfer.store.models import JobStatus, Request, RequestStatus, Shard
from batchinfer.wire.input_line import parse_line
from tests.store.helpers import submit_job

MAX_LINE_BYTES = 4096
DATA_FILE = Path(__file__).resolve().parents[1] / "data" / "bad_lines.jsonl"


def env(custom_id: str, body: object, *, url: str = "/v1/chat/completions", method: str = "POST") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat(custom_id: str, **fields: object) -> bytes:
    messages = [{"role": "user", "content": f"hello {custom_id}"}]
    return env(custom_id, {"model": "m", "messages": messages, **fields})


USER = [{"role": "user", "content": "hi"}]
# (raw line, None for a valid line or (error code, a fragment of the message))
CORPUS: list[tuple[bytes, tuple[str, str] | None]] = [
    (b"\xef\xbb\xbf" + chat("ok-bom"), None),  # a BOM on line 1 is not an error
    (chat("ok-crlf")[:-1] + b"}\r", None),  # CRLF line ending (the \n follows)
    (b'{"custom_id": "a", "method": "POST", ', ("invalid_json", "invalid JSON")),
    (b"   ", ("blank_line", "blank")),
    (b'{"prompt": "caf\xe9"}', ("invalid_encoding", "not valid UTF-8")),
    (b"[1, 2, 3]", ("invalid_json", "expected a JSON object, got an array")),
    (env(123, {"messages": USER}), ("invalid_request", "custom_id must be a string")),  # type: ignore[arg-type]
    (env("no-messages", {"model": "m"}), ("missing_required_parameter", "body.messages: missing")),
    (env("bad-url", {"messages": USER}, url="/v1/moderations"),
     ("invalid_url", "'/v1/moderations' is not supported")),
    (env("bad-method", {"messages": USER}, method="GET"), ("invalid_method", 'method must be "POST"')),
    (chat("neg-max", max_tokens=-5), ("invalid_value", "body.max_tokens: must be >= 1")),
    (chat("hot", temperature=3.5), ("invalid_request", "body.temperature: must be between 0 and 2")),
    (chat("cold", temperature=-1), ("invalid_value", "body.temperature: must be >= 0")),
    (chat("big", padding="x" * MAX_LINE_BYTES), ("line_too_long", "oversized line")),
    (chat("ok-1"), None),
    (chat("ok-1", max_tokens=3), ("duplicate_custom_id", "first used on line 15")),
    (env("empty-messages", {"messages": []}), ("invalid_request", "body.messages: must be a non-empty list")),
    (env("robot", {"messages": [{"role": "robot", "content": "x"}]}), ("invalid_request", "role 'robot'")),
    (env("image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
     ("invalid_request", "only text parts")),
    (chat("typo", temprature=0.2), ("invalid_request", "body.temprature: unknown")),
    (chat("top-p", top_p=0), ("invalid_value", "body.top_p")),
    (chat("n-zero", n=0), ("invalid_value", "body.n: must be >= 1")),
    (chat("stream", stream=True), ("invalid_request", "streaming is not available")),
    (orjson.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}),
     ("missing_required_parameter", "missing required field 'body'")),
    (orjson.dumps({"custom_id": "extra", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"},
                   "priority": 1}), ("invalid_request", "unknown field 'priority'")),
    (env("body-str", "just text"), ("invalid_request", "body must be a JSON object, got a string")),
    (env("prompt-num", {"prompt": 42}, url="/v1/completions"),
     ("invalid_request", "body.prompt: must be a string")),
    (env("prompt-empty", {"prompt": ""}, url="/v1/completions"), ("invalid_request", "must not be empty")),
    (chat("lp-int", logprobs=5), ("invalid_request", "body.logprobs: must be true or false")),
    (chat("top-lp", logprobs=True, top_logprobs=50), ("invalid_request", "from 0 to 20")),
    (chat("meta", metadata={f"k{i}": "v" * 500 for i in range(6)}),
     ("invalid_request", "max_metadata_bytes")),
    (chat("stop-ids", stop_token_ids=[-1]), ("invalid_value", "body.stop_token_ids")),
    (b'{"temperature": 0.5}', ("missing_required_parameter", "nor messages/prompt")),
    (chat("max-str", max_tokens="ten"), ("invalid_value", "body.max_tokens: must be an integer")),
    (chat("min-gt-max", max_tokens=2, min_tokens=5), ("invalid_value", "body.min_tokens")),
    (chat("presence", presence_penalty=5), ("invalid_value", "body.presence_penalty")),
    (env("", {"messages": USER}), ("invalid_request", "custom_id must be 1 to 512 characters")),
    (b'{"custom_id": "nan", "prompt": NaN}', ("invalid_json", "invalid JSON")),
    (env("both", {"messages": USER, "prompt": "x"}),
     ("invalid_request", "prompt belongs to /v1/completions")),
    (b'{"prompt": "ok shorthand", "max_tokens": 4}', None),
    (b'{"messages": [{"role": "user", "content": "ok"}], "seed": 1}', None),
    (b"", ("blank_line", "blank")),
    (chat("ok-2", max_tokens=8, temperature=0.0), None),
]


def corpus_bytes() -> bytes:
    return b"".join(raw + b"\n" for raw, _ in CORPUS) + b"\n\n"  # trailing blank lines are ignored


def test_checked_in_corpus_is_current():
    assert DATA_FILE.read_bytes() == corpus_bytes(), "regenerate: python -m tests.store.test_bad_lines"


def test_every_bad_line_gets_its_own_line_numbered_error(session):
    job = submit_job(session, model="m", stream=io.BytesIO(corpus_bytes()),
                          limits=IngestLimits(max_line_bytes=MAX_LINE_BYTES, max_metadata_bytes=2048))
    assert job.status == JobStatus.IN_PROGRESS
    rows = {r.line_number: r for r in session.scalars(select(Request).where(Request.job_id == job.id))}
    assert sorted(rows) == list(range(1, len(CORPUS) + 1))  # one row per line; trailing blanks dropped
    bad = 0
    for number, (raw, expected) in enumerate(CORPUS, start=1):
        row = rows[number]
        if expected is None:
            assert row.status == RequestStatus.PENDING, (number, row.error_message)
            continue
        bad += 1
        code, fragment = expected
        assert row.status == RequestStatus.ERRORED, (number, raw[:60])
        assert row.error_code == code, (number, row.error_code, row.error_message)
        assert row.error_message.startswith(f"line {number}: "), row.error_message
        assert fragment in row.error_message, (number, row.error_message)
    assert len(CORPUS) - bad == 6
    assert job.request_counts == {"total": len(CORPUS), "completed": 0, "failed": bad}
    assert job.num_errors == bad and [e["line"] for e in job.errors] == [n for n, (_, e) in
                                                                         enumerate(CORPUS, 1) if e]
    # custom_ids: kept when readable and unused, else line-<n>; the duplicate keeps neither
    assert rows[1].custom_id == "ok-bom" and rows[3].custom_id == "line-3" and rows[11].custom_id == "neg-max"
    assert rows[16].custom_id == "line-16" and rows[40].custom_id == "line-40"
    errors = [orjson.loads(x) for x in export_results(session, job_id=job.id, kind="errors")]
    assert [e["error"]["code"] for e in errors] == [e[0] for _, e in CORPUS if e]


def test_valid_lines_reach_the_worker_with_the_params_ingest_parsed(session):
    job = submit_job(session, model="m", stream=io.BytesIO(corpus_bytes()),
                          limits=IngestLimits(max_line_bytes=MAX_LINE_BYTES, max_metadata_bytes=2048))
    shard_ids = session.scalars(select(Shard.id).where(Shard.job_id == job.id)).all()
    pending = {r.line_number: r for shard_id in shard_ids for r in shards.pending_requests(session,
                                                                                           shard_id=shard_id)}
    assert len(pending) == 6
    for number, request in pending.items():
        raw = CORPUS[number - 1][0].removeprefix(BOM).removesuffix(b"\r")
        assert isinstance(request.params, SamplingParams)
        assert request.params == parse_line(raw, number).params, number
    ok_2 = next(r for r in pending.values() if r.custom_id == "ok-2")
    assert ok_2.params == SamplingParams(max_tokens=8, temperature=0.0)


def test_on_invalid_fail_fails_the_job_with_line_numbered_errors(session):
    job = submit_job(session, model="m", stream=io.BytesIO(corpus_bytes()),
                          on_invalid="fail",
                          limits=IngestLimits(max_line_bytes=MAX_LINE_BYTES, max_metadata_bytes=2048))
    assert job.status == JobStatus.FAILED and job.failed_at is not None
    assert job.errors[0]["code"] == "invalid_file" and "on_invalid='fail'" in job.errors[0]["message"]
    assert [e["line"] for e in job.errors[1:4]] == [3, 4, 5]
    assert session.scalar(select(Request.id).where(Request.job_id == job.id)) is None  # nothing left to run


@pytest.mark.parametrize(("content", "message"), [
    (b"", "the file is empty"),
    (b"\n\n\n", "the file is empty"),
    (bytes(range(256)) * 40, "no valid request"),
    (b"custom_id,prompt\nq1,hello\nq2,world\n", "is this a JSONL batch file?"),
])
def test_a_file_with_no_usable_line_fails_the_job(session, content, message):
    job = submit_job(session, model="m", stream=io.BytesIO(content))
    assert job.status == JobStatus.FAILED
    assert message in job.errors[0]["message"]


def test_too_many_requests_fails_the_job(session):
    lines = b"".join(b'{"prompt": "p%d"}\n' % i for i in range(30))
    job = submit_job(session, model="m", stream=io.BytesIO(lines),
                          limits=IngestLimits(max_requests=25))
    assert job.status == JobStatus.FAILED and "more than 25 requests" in job.errors[0]["message"]


if __name__ == "__main__":
    DATA_FILE.parent.mkdir(parents=True, exist_ok=True)
    DATA_FILE.write_bytes(corpus_bytes())
    print(f"wrote {DATA_FILE} ({len(CORPUS)} lines)")
