"""The result cache through the REST API (issue 31): the openai client's extra_body picks the mode, an
owner's repeated batch is served from the cache, another owner's identical batch is not (a hit is an
oracle), provenance on every output line."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.api.app import create_app
from batchinfer.store.db import upgrade
from batchinfer.store.models import JOB_TERMINAL_STATUSES
from tests.api.conftest import make_settings
from tests.api.helpers import chat_line, jsonl, serve


@pytest.fixture
def live(tmp_path: Path, sqlite_url: str, tiny_llama: Path, make_key):
    """(base url, alice's key, bob's key) of a uvicorn server with a worker on the tiny model."""
    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, default_model=str(tiny_llama), device="cpu",
                             kv_cache_memory_bytes=16 << 20, max_num_seqs=16, max_num_batched_tokens=256)
    alice, _ = make_key("alice")
    bob, _ = make_key("bob")
    stop = threading.Event()
    from workers.process import make_runner, poll_forever

    runner = make_runner(model=str(tiny_llama), settings=settings)
    thread = threading.Thread(target=poll_forever, args=(runner,), daemon=True, name="local-worker",
                              kwargs={"stop": stop, "max_backoff_s": 0.2})
    with serve(create_app(settings)) as base:
        thread.start()
        yield base, alice, bob
        stop.set()
        thread.join(timeout=30)


def _run(base: str, key: str, path: Path, **extra: str) -> tuple[dict, list[dict]]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_body=extra or None)
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in JOB_TERMINAL_STATUSES:
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.1)
    assert batch.status == "completed", batch.errors
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    return batch.to_dict(), lines


def test_owners_do_not_share_cached_results(live, tmp_path: Path) -> None:
    base, alice, bob = live
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(jsonl([chat_line(f"req-{i}", f"Tell me about number {i}", temperature=0)
                            for i in range(4)] + [chat_line("seeded", "a draw", temperature=0.9, seed=3)]))
    first, first_lines = _run(base, alice, path)
    assert first["result_cache"] == {"mode": "use", "hits": 0, "dedups": 0}
    assert {line["provenance"]["result_cache"] for line in first_lines} == {"miss"}

    gauges = {sample.name: sample.value  # the cache's size, from the database at scrape time
              for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
              for sample in family.samples}
    assert gauges["batchinfer:result_cache_bodies"] == 5 and gauges["batchinfer:result_cache_bytes"] > 0
    again, again_lines = _run(base, alice, path)
    assert again["result_cache"]["hits"] == 5
    assert [line["response"]["body"]["choices"] for line in again_lines] == [
        line["response"]["body"]["choices"] for line in first_lines]
    assert {line["provenance"]["computed_in"] for line in again_lines} == {first["id"]}

    other, other_lines = _run(base, bob, path)  # the same requests, another owner: computed
    assert other["result_cache"]["hits"] == 0
    assert {line["provenance"]["result_cache"] for line in other_lines} == {"miss"}

    off, off_lines = _run(base, alice, path, result_cache="off")
    assert off["result_cache"] == {"mode": "off", "hits": 0, "dedups": 0}
    assert {line["provenance"]["computed_in"] for line in off_lines} == {off["id"]}

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=alice, max_retries=0, timeout=60)
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="24h", extra_body={"result_cache": "sometimes"})
    assert "result_cache" in str(refused.value)
