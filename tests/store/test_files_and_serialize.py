"""Store helpers the API is built on: staged uploads (sync and async), file rows, public ids, serializers."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from batchinfer.store import files as file_store
from batchinfer.store.models import File, Job, JobStatus
from batchinfer.store.serialize import (
    FileRef,
    batch_object,
    error_file_id,
    file_object,
    output_file_id,
    parse_batch_id,
    parse_file_id,
)

LINE = b'{"custom_id": "a", "prompt": "hi"}\n'


def test_stage_upload_sync_and_async_then_register(make_session, tmp_path: Path):
    staged = file_store.stage_upload([LINE[:5], LINE[5:], LINE], data_dir=tmp_path, max_bytes=1000)
    assert staged.size == 2 * len(LINE) and staged.tmp_path.read_bytes() == 2 * LINE

    async def chunks():
        for piece in (b"\xef\xbb\xbf", LINE):  # a UTF-8 BOM before line 1 is accepted
            yield piece

    staged_async = asyncio.run(file_store.stage_upload_async(chunks(), data_dir=tmp_path, max_bytes=1000))
    with make_session() as session:
        first = file_store.create_file(session, owner="o", staged=staged, filename="a.jsonl")
        second = file_store.create_file(session, owner="o", staged=staged_async, filename="b.jsonl")
        assert Path(first.path).name == f"file-{first.id}.jsonl" and Path(first.path).read_bytes() == 2 * LINE
        assert not staged.tmp_path.exists()
        rows, has_more = file_store.list_files(session, owner="o", limit=1)
        assert [r.id for r in rows] == [second.id] and has_more
        rows, _ = file_store.list_files(session, owner="o", order="asc", after=first.id)
        assert [r.id for r in rows] == [second.id]
        assert file_store.get_file(session, owner="someone-else", file_id=first.id) is None
        assert not file_store.delete_file(session, owner="someone-else", file_id=first.id)
        assert file_store.delete_file(session, owner="o", file_id=first.id)
        assert not Path(first.path).exists()
        assert file_store.get_file(session, owner="o", file_id=first.id) is None
        with pytest.raises(ValueError, match="purpose"):
            file_store.create_file(session, owner="o", staged=staged_async, filename="c", purpose="fine-tune")


@pytest.mark.parametrize(("chunks", "error", "says"), [
    ([LINE] * 50, file_store.FileTooLarge, "limit of 100 bytes"),
    ([b"", b"  \n\n"], file_store.InvalidFile, "empty"),
    ([b'{"a": 1'], file_store.InvalidFile, "not valid JSON"),
    ([b"[1, 2]\n", LINE], file_store.InvalidFile, "a JSON list"),
    ([b"x" * 300], file_store.InvalidFile, "longer than 200 bytes"),
])
def test_stage_upload_refuses_and_leaves_nothing(tmp_path: Path, chunks, error, says):
    with pytest.raises(error, match=says):
        max_bytes = 100 if error is file_store.FileTooLarge else 10_000
        file_store.stage_upload(chunks, data_dir=tmp_path, max_bytes=max_bytes, max_line_bytes=200)
    assert list(file_store.files_dir(tmp_path).iterdir()) == []


def test_public_ids_round_trip():
    assert parse_batch_id("batch_42") == 42
    for bad in ("batch_0", "batch_", "batch_1x", "batch-1", "42", "batch_" + "9" * 30):
        assert parse_batch_id(bad) is None
    assert parse_file_id("file-7") == FileRef("input", 7)
    assert parse_file_id("file-out-7") == FileRef("output", 7)
    assert parse_file_id("file-err-7") == FileRef("error", 7)
    for bad in ("file-", "file-x-7", "file-out-", "file-007", "out-7"):
        assert parse_file_id(bad) is None


def _job(**values) -> Job:
    created = datetime(2024, 1, 1, tzinfo=UTC)
    defaults = dict(id=3, owner="o", model="m", endpoint="/v1/completions", status=JobStatus.IN_PROGRESS,
                    input_file_id=9, completion_window="24h", shard_size=4, created_at=created,
                    expires_at=created + timedelta(hours=24), in_progress_at=created + timedelta(seconds=10),
                    total_requests=10, completed_requests=4, failed_requests=1, prompt_tokens=100,
                    completion_tokens=50, cached_tokens=20, meta={"k": "v"},
                    errors=[{"code": "invalid_json", "line": 2, "message": "line 2: bad", "param": None}])
    defaults.update(values)
    return Job(**defaults)


def test_batch_object_matches_openai_and_reports_progress():
    job = _job()
    now = job.in_progress_at + timedelta(seconds=10)
    batch = batch_object(job, now=now).model_dump(mode="json")
    assert batch["id"] == "batch_3" and batch["input_file_id"] == "file-9"
    assert batch["status"] == "in_progress"
    assert batch["created_at"] == 1704067200 and batch["expires_at"] == 1704067200 + 86400
    assert batch["errors"] == {"object": "list", "data": [{"code": "invalid_json", "line": 2,
                                                           "message": "line 2: bad", "param": None}]}
    assert batch["usage"] == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 20},
                              "output_tokens": 50, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 150}
    assert batch["output_file_id"] is None and batch["error_file_id"] is None  # not finished yet
    # 5 of 10 done in 10 s, 10 tokens each: 5 more are ~50 tokens, ~10 s at 5 tokens/s.
    assert batch["progress"] == {"fraction": 0.5, "tokens_per_second": 5.0, "requests_per_second": 0.5,
                                 "eta_seconds": 10.0, "started_at": None, "generated_tokens": 50,
                                 "remaining_tokens": 50, "input_tokens_per_second": 10.0,
                                 "at_risk": False, "note": None}  # 10 s left of a 24 h window


def test_result_files_are_offered_once_the_job_is_done():
    done = _job(status=JobStatus.COMPLETED, completed_at=datetime(2024, 1, 1, 1, tzinfo=UTC),
                completed_requests=9, failed_requests=1)
    assert output_file_id(done) == "file-out-3" and error_file_id(done) == "file-err-3"
    assert batch_object(done).progress.eta_seconds is None
    all_ok = _job(status=JobStatus.COMPLETED, completed_requests=10, failed_requests=0)
    assert output_file_id(all_ok) == "file-out-3" and error_file_id(all_ok) is None
    all_failed = _job(status=JobStatus.FAILED, completed_requests=0, failed_requests=0, total_requests=0)
    assert output_file_id(all_failed) is None and error_file_id(all_failed) is None
    # Issue 29 item 5: a batch that failed with no request is not a full bar; an empty completed one is.
    assert batch_object(all_failed).progress.fraction == 0.0
    empty = _job(status=JobStatus.COMPLETED, completed_requests=0, failed_requests=0, total_requests=0)
    assert batch_object(empty).progress.fraction == 1.0


def test_file_object_shape():
    row = File(id=5, owner="o", filename="in.jsonl", purpose="batch", bytes=12, path="/x",
               created_at=datetime(2024, 1, 1, tzinfo=UTC))
    assert file_object(row).model_dump() == {"id": "file-5", "object": "file", "bytes": 12,
                                             "created_at": 1704067200, "expires_at": None,
                                             "filename": "in.jsonl", "purpose": "batch",
                                             "status": "processed", "status_details": None}
