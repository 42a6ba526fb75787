"""Streaming ingestion pieces: line reading, prefix keys, duplicates across committed chunks, examples."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
from sqlalchemy import select

from batchinfer.store.ingest import IngestLimits, iter_lines, prefix_key
from batchinfer.store.models import Job, JobStatus, Request, RequestStatus
from tests.store.helpers import chat_line, jsonl, submit_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


class OneByteReads(io.RawIOBase):
    """A stream that returns at most a few bytes per read, like a slow upload."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self.data[self.pos:self.pos + 3]
        buffer[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def test_iter_lines_handles_bom_crlf_oversize_and_blank_lines():
    data = b"\xef\xbb\xbf{\"a\":1}\r\n\n{\"b\":2}\n" + b"x" * 50 + b"\n  \t\n{\"c\":3}" + b"\n\n \n"
    got = list(iter_lines(io.BufferedReader(OneByteReads(data)), max_line_bytes=20))
    assert got == [(1, b'{"a":1}', None), (2, b"", "blank"), (3, b'{"b":2}', None),
                   (4, b"", "oversized line (51 bytes; max_line_bytes is 20)"), (5, b"", "blank"),
                   (6, b'{"c":3}', None)]  # the trailing blank lines 7-8 are dropped


def test_an_oversized_line_is_skipped_without_reading_it_whole():
    huge = b'{"prompt": "' + b"y" * 300_000 + b'"}\n'
    got = list(iter_lines(io.BytesIO(b'{"prompt":"a"}\n' + huge + b'{"prompt":"b"}'), max_line_bytes=1000))
    assert [(n, problem and problem.split(" (")[0]) for n, _, problem in got] == [
        (1, None), (2, "oversized line"), (3, None)]
    assert "300015 bytes" in got[1][2]


def test_prefix_key_orders_shared_prefixes_together():
    system = "You are a meticulous assistant. " * 10
    shared = sorted([prefix_key(system + f"question {i}") for i in range(50)])
    others = [prefix_key(f"unrelated prompt {i}") for i in range(50)]
    assert min(shared + others) >= 0 and max(shared + others) < 2**63
    # nothing unrelated sorts inside the block of keys that share the 256-byte prefix
    assert not [k for k in others if shared[0] <= k <= shared[-1]]
    assert prefix_key("same") == prefix_key("same") and prefix_key("") == 0


def test_duplicates_are_found_across_committed_chunks(db_url, session):
    lines = [chat_line(f"id-{i % 7}", f"q{i}") for i in range(20)]  # ids repeat every 7 lines
    from batchinfer.store.ingest import ingest_file

    job = Job(model="m", shard_size=4, status=JobStatus.VALIDATING)
    session.add(job)
    session.commit()
    result = ingest_file(session.get_bind(), job_id=job.id, stream=jsonl(*lines), limits=IngestLimits(),
                         chunk_rows=3)
    assert (result.total, result.valid, result.invalid) == (20, 7, 13)
    columns = (Request.line_number, Request.status, Request.custom_id, Request.error_message)
    rows = session.execute(select(*columns).where(Request.job_id == job.id)
                           .order_by(Request.line_number)).all()
    assert [r.status for r in rows[:7]] == [RequestStatus.PENDING] * 7
    assert rows[7].error_message == ("line 8: duplicate custom_id 'id-0' (first used on line 1); "
                                     "custom_ids must be unique within a file")
    assert rows[19].error_message.startswith("line 20: duplicate custom_id 'id-5' (first used on line 6)")
    assert rows[19].custom_id == "line-20"


def test_the_example_file_ingests_cleanly(session):
    job = submit_job(session, model="m", path=EXAMPLES, on_invalid="fail", shard_size=8)
    assert job.status == JobStatus.IN_PROGRESS, job.errors
    lines = [orjson.loads(x) for x in EXAMPLES.read_bytes().splitlines()]
    assert job.total_requests == len(lines) >= 20
    kinds = {("body" in x, x.get("url")) for x in lines}
    assert {(True, "/v1/chat/completions"), (True, "/v1/completions"), (False, None)} <= kinds
    assert all((x.get("body", x).get("max_tokens") or x.get("body", x).get("max_completion_tokens")) <= 64
               for x in lines)
