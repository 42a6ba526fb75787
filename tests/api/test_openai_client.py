"""The official `openai` package, unchanged, against a live server with a local worker on the tiny model."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai
import pytest

from batchinfer.api.app import create_app
from batchinfer.store.db import upgrade
from batchinfer.store.models import JOB_TERMINAL_STATUSES
from tests.api.conftest import make_settings
from tests.api.helpers import chat_line, jsonl, serve


@pytest.fixture
def live(tmp_path: Path, sqlite_url: str, tiny_llama: Path, make_key):
    """(base url, api key, settings, start_worker) of a uvicorn server on the tiny model."""
    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, default_model=str(tiny_llama), device="cpu",
                             kv_cache_memory_bytes=16 << 20, max_num_seqs=16, max_num_batched_tokens=256)
    key, _ = make_key("alice")
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start_worker() -> None:
        from workers.process import make_runner, poll_forever

        runner = make_runner(model=str(tiny_llama), settings=settings)
        thread = threading.Thread(target=poll_forever, args=(runner,),
                                  kwargs={"stop": stop, "max_backoff_s": 0.2}, daemon=True,
                                  name="local-worker")
        thread.start()
        threads.append(thread)

    with serve(create_app(settings)) as base:
        yield base, key, settings, start_worker
        stop.set()
        for thread in threads:
            thread.join(timeout=30)


def test_openai_client_runs_the_whole_batch_flow_unchanged(live, tmp_path: Path):
    base, key, _, start_worker = live
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(jsonl([chat_line(f"req-{i}", f"Tell me about number {i}", max_tokens=6, temperature=0)
                            for i in range(8)]))

    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == path.stat().st_size
    assert uploaded.purpose == "batch" and uploaded.filename == "prompts.jsonl"

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "ci"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "ci"}
    doomed = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    cancelled = client.batches.cancel(doomed.id)  # no worker yet: nothing running, cancelled at once
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None

    start_worker()
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in JOB_TERMINAL_STATUSES:
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.1)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.total == 8 and batch.request_counts.completed == 8
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert batch.usage is not None and batch.usage.output_tokens > 0
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at

    listed = [b.id for b in client.batches.list(limit=1)]  # auto-pagination through `after`
    assert listed == [doomed.id, batch.id]
    assert client.batches.retrieve(doomed.id).status == "cancelled"

    output = client.files.content(batch.output_file_id)
    lines = [json.loads(line) for line in output.text.splitlines()]
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(8)]
    for line in lines:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert 0 < body["usage"]["completion_tokens"] <= 6
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_openai_client_sees_openai_errors(live):
    base, key, _, _ = live
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.batches.create(input_file_id="file-31337", endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert missing.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError, match="only 'batch'"):
        client.files.create(file=("x.jsonl", b'{"prompt": "hi"}\n'), purpose="fine-tune")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="bi-wrong", max_retries=0).batches.list()
