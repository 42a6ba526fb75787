"""Fair share under the production topology (issue 32): two owners, each with its own API key, share two
Celery workers on PostgreSQL and Redis (`batchinfer api` + `beat` + `worker`s, each an OS process), driven
through the CLI and REST as the owners drive it (each with its key) and the CLI as the operator does.

Owner alice submits a big job first; once it runs, bob submits a small one: bob's job completes while
alice's is at most half done. Then one worker is killed with -9 in the middle of alice's job: bob's next
small job still gets its turn on the worker left (it runs before half of what alice has left), and every
custom_id of every job ends exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.servers import RedisServer, wait_for
from tests.acceptance.topology import Topology, custom_ids, write_chat_requests

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres, pytest.mark.redis]

OWNERS = ("alice", "bob")
BIG_LINES, SMALL_LINES, MAX_TOKENS = 128, 4, 384  # 32 shards of 4 (FAST_SETTINGS) against 1


@pytest.fixture(scope="module")
def fleet(redis_binary: None, fresh_pg_database: str, tiny_llama: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Topology, dict[str, str]]]:
    """PostgreSQL + a private Redis + `batchinfer api` (auth on) + `beat` + two Celery workers; the API
    key of each owner."""
    tmp = tmp_path_factory.mktemp("fair-share")
    redis = RedisServer(tmp)
    redis.start()
    topology = Topology(tmp, database_url=fresh_pg_database, model=tiny_llama, broker_url=redis.url,
                        extra_env={"BATCHINFER_AUTH_DISABLED": "false"})
    try:
        keys = {owner: topology.cli_json("apikey", "create", "--name", owner)[0]["key"] for owner in OWNERS}
        topology.rest.headers["Authorization"] = f"Bearer {keys['alice']}"  # start_api lists her batches
        topology.start_api()
        topology.start_beat(wait=False)
        topology.workers_exactly(2)
        topology.wait_beat()
        yield topology, keys
    finally:
        topology.stop()
        topology.rest.close()
        redis.stop()


def _submit(topology: Topology, key: str, name: str, count: int) -> tuple[str, list[str]]:
    """Upload and create a batch over REST with `key` (as its owner would); returns (batch id, custom_ids)."""
    path = topology.tmp / f"{name}.jsonl"
    ids = write_chat_requests(path, count, max_tokens=MAX_TOKENS, prefix=name)
    auth = {"Authorization": f"Bearer {key}"}
    upload = topology.rest.post("/files", headers=auth, data={"purpose": "batch"},
                                files={"file": (path.name, path.read_bytes())})
    upload.raise_for_status()
    batch = topology.rest.post("/batches", headers=auth, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    batch.raise_for_status()
    return batch.json()["id"], ids


def _batch(topology: Topology, key: str, batch_id: str) -> dict[str, Any]:
    response = topology.rest.get(f"/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"})
    response.raise_for_status()
    return response.json()


def _done_when_completed(topology: Topology, keys: dict[str, str], small: str, big: str) -> int:
    """Wait until bob's `small` batch completes; returns how many lines alice's `big` one had done then
    (read right after: never fewer than at that moment)."""
    def finished() -> dict[str, int] | None:
        batch = _batch(topology, keys["bob"], small)
        assert batch["status"] in ("validating", "in_progress", "finalizing", "completed"), batch
        if batch["status"] != "completed":
            return None
        return {"alice_done": _batch(topology, keys["alice"], big)["request_counts"]["completed"]}
    return wait_for(finished, timeout=60, what=f"bob's {small} to complete",
                    on_timeout=topology.logs)["alice_done"]


def test_two_owners_share_two_celery_workers_and_the_share_holds_through_a_kill_9(
        fleet: tuple[Topology, dict[str, str]]) -> None:
    topology, keys = fleet
    workers = topology.workers_exactly(2)
    path = topology.tmp / "alice.jsonl"  # alice uses the CLI against the API, with her key
    big_ids = write_chat_requests(path, BIG_LINES, max_tokens=MAX_TOKENS, prefix="alice")
    printed = topology.cli_json("submit", str(path), remote=True,
                                env={"BATCHINFER_API_KEY": keys["alice"]})[0]
    big = printed["id"]
    assert printed["estimate"]["max_output_tokens"] == BIG_LINES * MAX_TOKENS  # the estimate at submit
    wait_for(lambda: _batch(topology, keys["alice"], big)["request_counts"]["completed"] > 0, timeout=60,
             what="alice's job to run", on_timeout=topology.logs)

    small, small_ids = _submit(topology, keys["bob"], "bob-1", SMALL_LINES)
    done = _done_when_completed(topology, keys, small, big)
    assert done <= BIG_LINES // 2, f"alice had done {done} of {BIG_LINES} lines when bob's job completed"

    victim = topology.holder_of_a_shard(workers)  # mid-job: a shard of alice's in flight
    topology.kill(victim)
    before = _batch(topology, keys["alice"], big)["request_counts"]["completed"]
    assert before < BIG_LINES - SMALL_LINES, "alice's job ended before the kill: make it bigger"
    second, second_ids = _submit(topology, keys["bob"], "bob-2", SMALL_LINES)
    after = _done_when_completed(topology, keys, second, big)
    assert after - before <= (BIG_LINES - before) / 2, (
        f"with one worker left, alice went from {before} to {after} of {BIG_LINES} lines while bob's "
        "second job waited: the share did not hold")

    finished = wait_for(lambda: (batch := _batch(topology, keys["alice"], big))["status"] in
                        ("completed", "failed") and batch, timeout=120, what="alice's job to end",
                        on_timeout=topology.logs)
    assert finished["status"] == "completed", finished
    for batch_id, ids in ((big, big_ids), (small, small_ids), (second, second_ids)):
        output, errors = topology.results(batch_id)  # the operator's CLI: any owner's job
        assert custom_ids(output) == ids and errors == [], f"{batch_id}: every custom_id exactly once"
        assert all(line["response"]["status_code"] == 200 for line in output)
