"""What OpenAI Batch users do, through the official `openai` client (issue 18): list and delete output and
error files, watch a cancel pass through `cancelling`, ask for all-or-nothing validation, a priority and
a shard size in the create body."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api.app import create_app
from batchinfer.config import Settings
from batchinfer.store.models import Job
from batchinfer.store.shards import claim_shard, heartbeat, release_shard
from tests.api.conftest import TEST_MODEL
from tests.api.helpers import FixedOutputWorker, chat_line, jsonl, serve


@pytest.fixture
def openai_client(api_settings: Settings, make_key) -> Iterator[openai.OpenAI]:
    key, _ = make_key("alice")
    with serve(create_app(api_settings)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def _upload(client: openai.OpenAI, tmp_path: Path, lines: list[bytes]) -> str:
    path = tmp_path / f"in-{time.monotonic_ns()}.jsonl"
    path.write_bytes(jsonl(lines))
    return client.files.create(file=path.open("rb"), purpose="batch").id


def _wait_for(client: openai.OpenAI, batch_id: str, status: str) -> openai.types.Batch:
    deadline = time.monotonic() + 30
    while (batch := client.batches.retrieve(batch_id)).status != status:
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.05)
    return batch


def test_output_and_error_files_are_listed_and_deletable(openai_client, factory, tmp_path, make_key,
                                                         api_settings) -> None:
    client = openai_client
    upload = _upload(client, tmp_path, [chat_line(f"c{i}", "hi") for i in range(3)] + [b'{"custom_id": 1}'])
    batch = client.batches.create(input_file_id=upload, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    with FixedOutputWorker(factory, model=TEST_MODEL):
        batch = _wait_for(client, batch.id, "completed")
    out_id, err_id = batch.output_file_id, batch.error_file_id
    assert out_id and err_id

    outputs = client.files.list(purpose="batch_output")
    assert [f.id for f in outputs.data] == [err_id, out_id]  # newest job first, its error file first
    assert {f.purpose for f in outputs.data} == {"batch_output"} and all(f.bytes > 0 for f in outputs.data)
    assert [f.id for f in client.files.list(purpose="batch").data] == [upload]
    assert [f.id for f in client.files.list().data] == [upload, err_id, out_id]  # uploads, then results
    page = client.files.list(purpose="batch_output", limit=1)
    assert [f.id for f in page.data] == [err_id] and page.has_more
    assert [f.id for f in client.files.list(purpose="batch_output", after=err_id).data] == [out_id]
    ascending = client.files.list(purpose="batch_output", order="asc")
    assert [f.id for f in ascending.data] == [out_id, err_id]

    other_key, _ = make_key("mallory")
    other = openai.OpenAI(base_url=str(client.base_url), api_key=other_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(out_id)
    assert other.files.list(purpose="batch_output").data == []

    assert client.files.delete(out_id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(out_id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(out_id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(out_id)
    assert [f.id for f in client.files.list(purpose="batch_output").data] == [err_id]
    assert client.files.content(err_id).text.count("\n") == 1  # the error file is untouched
    kept = client.batches.retrieve(batch.id)
    assert kept.request_counts.completed == 3 and kept.output_file_id == out_id  # as OpenAI keeps it
    assert client.files.delete(err_id).deleted is True
    assert client.files.list(purpose="batch_output").data == []


def test_cancel_passes_through_cancelling_while_a_worker_aborts(openai_client, factory, tmp_path) -> None:
    client = openai_client
    upload = _upload(client, tmp_path, [chat_line(f"c{i}", "hi") for i in range(3)])
    batch = client.batches.create(input_file_id=upload, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    with factory() as session:
        lease = claim_shard(session, worker_id="busy", model=TEST_MODEL, lease_seconds=60)
        assert lease is not None  # a worker runs the (only) shard now
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    assert client.batches.retrieve(batch.id).status == "cancelling"
    with factory() as session:  # the worker's next heartbeat says stop; it aborts and lets go
        assert heartbeat(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                         lease_seconds=60) is False
        release_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)
    cancelled = _wait_for(client, batch.id, "cancelled")
    assert cancelled.cancelled_at is not None and cancelled.request_counts.completed == 0


def _job(factory: sessionmaker[Session], batch_id: str) -> Job:
    with factory() as session:
        return session.get(Job, int(batch_id.removeprefix("batch_")))


def test_create_body_extensions_on_invalid_priority_shard_size(openai_client, factory, tmp_path) -> None:
    client = openai_client
    lines = [chat_line(f"c{i}", "hi") for i in range(4)]
    with_bad = _upload(client, tmp_path, [*lines, b'{"custom_id": "x", "method": "GET"}'])
    strict = client.batches.create(input_file_id=with_bad, endpoint="/v1/chat/completions",
                                   completion_window="24h", extra_body={"on_invalid": "fail"})
    assert strict.status == "failed" and strict.errors.data[-1].line == 5
    lenient = client.batches.create(input_file_id=with_bad, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    assert lenient.status == "in_progress" and lenient.request_counts.total == 5

    tuned = client.batches.create(input_file_id=_upload(client, tmp_path, lines), completion_window="24h",
                                  endpoint="/v1/chat/completions",
                                  extra_body={"priority": -3, "shard_size": 1})
    job = _job(factory, tuned.id)
    assert (job.priority, job.shard_size, job.num_shards, job.on_invalid) == (-3, 1, 4, "skip")

    for bad in ({"on_invalid": "maybe"}, {"shard_size": 0}, {"priority": 2**40}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=with_bad, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_body=bad)
        assert next(iter(bad)) in str(refused.value)
