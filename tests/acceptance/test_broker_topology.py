"""The README's production shape keeps its promises: PostgreSQL + Redis + `batchinfer api` + `batchinfer beat`
+ `batchinfer worker`s on the tiny model, each an OS process, driven only through the CLI and REST.

One test per promise (README, "Reliability"). Intervals are seconds (tests/acceptance/topology.py), so
each recovery path runs for real: lease expiry, periodic rescue, expiry sweep, schedule ticks, the ingest
lease. Jobs generate exactly max_tokens tokens per request (ignore_eos), so they last long enough to be
interrupted. The tests share one topology and run in an order that restarts few workers (each asks for
the number of workers it needs, so any order is correct).
"""

from __future__ import annotations

import signal
import time
from datetime import datetime
from pathlib import Path

import orjson
import pytest

from tests.acceptance.servers import WebhookReceiver, wait_for
from tests.acceptance.topology import Topology, custom_ids, read_jsonl, write_chat_requests
from workers.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres, pytest.mark.redis]


def _submit(cluster: Topology, name: str, count: int, *, max_tokens: int) -> tuple[str, list[str]]:
    """Submit through the CLI against the API (as a remote user); returns (batch id, custom_ids)."""
    path = cluster.tmp / f"{name}.jsonl"
    ids = write_chat_requests(path, count, max_tokens=max_tokens, prefix=name)
    batch = cluster.cli_json("submit", str(path), remote=True)[0]
    assert batch["status"] in ("validating", "in_progress"), batch
    return batch["id"], ids


def _assert_all_succeeded_once(cluster: Topology, batch_id: str, ids: list[str]) -> None:
    output, errors = cluster.results(batch_id)
    assert custom_ids(output) == ids, "every custom_id exactly once, each with a result"
    assert errors == []
    assert all(line["response"]["status_code"] == 200 for line in output)


def test_a_schedule_under_beat_runs_each_slot_exactly_once_with_its_webhook(cluster: Topology) -> None:
    receiver = WebhookReceiver()
    pipeline = cluster.tmp / "data" / "nightly"  # schedules read and write inside the data dir only
    pipeline.mkdir(parents=True, exist_ok=True)
    ids = write_chat_requests(pipeline / "prompts.jsonl", 3, max_tokens=4, prefix="nightly")
    out_template = str(pipeline / "out" / "{date:%H%M%S}.jsonl")
    cluster.start_beat("beat-2")  # two beats tick the same schedule: still one job per slot
    try:
        cluster.cli("schedule", "add", "every-3s", "--cron", "* * * * * */3", "--input",
                    str(pipeline / "prompts.jsonl"), "--output", out_template, "--webhook", receiver.url,
                    "--webhook-secret", "s3cret")
        added = time.monotonic()
        wait_for(lambda: len(receiver.received) >= 2, timeout=45, what="two webhooks",
                 on_timeout=cluster.logs)
        first_webhook_after = time.monotonic() - added
        cluster.cli("schedule", "pause", "every-3s")
    finally:
        cluster.stop(["beat-2"])
        receiver.close()

    payloads = []
    for headers, body in receiver.received:
        assert verify("s3cret", headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
        payloads.append(orjson.loads(body))
    assert len({p["run_id"] for p in payloads}) == len(payloads), "one webhook per run"
    slots = [datetime.fromisoformat(p["slot"]) for p in payloads]
    assert len(set(slots)) == len(slots) and all(slot.second % 3 == 0 for slot in slots)
    for payload in payloads:
        assert payload["status"] == "completed" and payload["job_status"] == "completed", payload
        assert payload["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert custom_ids(read_jsonl(Path(payload["output_path"]))) == ids
    assert first_webhook_after < 3 + 15  # the first slot within 3 s, then ticks of 1 s run and report it

    runs = cluster.cli_json("schedule", "show", "every-3s")[0]["runs"]
    assert len({run["slot"] for run in runs}) == len(runs)  # each slot claimed once, by one of the beats
    jobs = [run["job"] for run in runs if run["job"]]
    assert len(set(jobs)) == len(jobs), "exactly one job per slot"
    delivered = {p["job_id"] for p in payloads}
    assert delivered <= set(jobs) and all(run["status"] == "completed" for run in runs
                                          if run["job"] in delivered)


def test_a_job_past_its_window_expires_mid_run(cluster: Topology) -> None:
    workers = cluster.workers_exactly(2)
    logged_before = {name: len(cluster.log(name)) for name in workers}
    path = cluster.tmp / "expire.jsonl"
    # Short requests finish inside the 2 s window; long ones (448 tokens) are still running when it closes.
    # One shard of 128 (64 long ones, two at a time: ~14k steps, 10 s or more here) keeps its worker mid-shard
    # well past the window and the worker's 1 s heartbeat check (smaller shards of the tiny model could
    # finish between two checks, and then no in-flight request is left to abort).
    ids = write_chat_requests(path, 128, max_tokens=448, short_tokens=8, prefix="expire")
    started = time.monotonic()
    result = cluster.cli("submit", str(path), "--completion-window", "2s", "--shard-size", "128", "--wait",
                         "--json", remote=True, check=False, timeout=60)
    assert result.returncode == 6, result.stdout + result.stderr  # 6: expired
    assert time.monotonic() - started < 20  # window + sweep interval + the workers letting go
    printed = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert printed["status"] == "expired"
    batch_id = printed["id"]
    expired = cluster.batch(batch_id)
    assert expired["status"] == "expired" and expired["expired_at"] is not None

    output, errors = cluster.results(batch_id, remote=True)  # the output and error files, over REST
    assert custom_ids(output + errors) == ids  # every line answered exactly once
    assert output, "requests finished before the window closed keep their results"
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert errors and {line["error"]["code"] for line in errors} == {"batch_expired"}
    # The workers aborted the in-flight requests and let go of the job's shards (what a cancel does). The
    # batch turns expired before a worker's next heartbeat check notices, so its log line may come later.
    stopped = "stopped (job no longer in progress"
    deadline = time.monotonic() + 15
    while not any(stopped in cluster.log(name)[logged_before[name]:] for name in workers):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    assert cluster.batch(batch_id)["request_counts"] == expired["request_counts"]


def test_a_submit_killed_mid_ingest_fails_clearly_and_a_retry_makes_a_new_job(cluster: Topology) -> None:
    big = cluster.tmp / "big.jsonl"
    write_chat_requests(big, 100_000, max_tokens=1, prefix="big")
    key = "big-2026-12-01"
    known = {batch["id"] for batch in cluster.rest.get("/batches", params={"limit": 100}).json()["data"]}
    # The CLI without --server ingests in its own process: kill -9 it while the job is `validating`.
    submit = cluster.start("submit-killed", "submit", str(big), "--idempotency-key", key)

    def validating() -> str | None:
        for batch in cluster.rest.get("/batches").json()["data"]:
            if batch["id"] not in known and batch["status"] == "validating":
                return batch["id"]
        assert submit.poll() is None, "the submit finished before it could be killed: use a larger file"
        return None

    batch_id = wait_for(validating, timeout=60, interval=0.05, what="the job to be validating")
    cluster.kill("submit-killed")
    killed_at = time.monotonic()

    failed = cluster.wait_status(batch_id, {"failed", "in_progress", "completed"}, timeout=30)
    assert failed["status"] == "failed"
    assert time.monotonic() - killed_at < 5 + 1 + 10  # ingest lease + rescue interval + slack
    error = failed["errors"]["data"][0]
    assert error["code"] == "ingest_lost"
    assert "ingest stopped" in error["message"] and "Submit the file again" in error["message"]
    assert failed["request_counts"]["total"] == 0

    # A retry with the same key is a new job that runs, never the wedged one.
    retry = cluster.cli_json("submit", str(big), "--idempotency-key", key, timeout=180)[0]
    assert retry["id"] != batch_id and retry["status"] == "in_progress"
    assert retry["request_counts"]["total"] == 100_000
    small = cluster.tmp / "small.jsonl"
    write_chat_requests(small, 2, max_tokens=1)
    again = cluster.cli_json("submit", str(small), "--idempotency-key", key)[0]
    assert again["id"] == retry["id"]  # and that key now names the retry
    cluster.cli("cancel", retry["id"])


def test_kill_9_one_of_two_workers_the_other_finishes_exactly_once(cluster: Topology) -> None:
    workers = cluster.workers_exactly(2)
    batch_id, ids = _submit(cluster, "kill9", 64, max_tokens=192)
    cluster.wait_done(batch_id, 4)
    victim = cluster.holder_of_a_shard(workers)
    cluster.kill(victim)
    killed_at = time.monotonic()

    batch = cluster.wait_status(batch_id, {"completed", "failed"}, timeout=60)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": len(ids), "completed": len(ids), "failed": 0}
    assert time.monotonic() - killed_at < 60
    _assert_all_succeeded_once(cluster, batch_id, ids)


def test_kill_9_the_only_worker_and_restart_it_at_once(cluster: Topology) -> None:
    cluster.workers_exactly(0)
    # Its leases outlast its restart, so the restarted worker's start-up rescue finds none expired yet:
    # the periodic rescue (beat's, the worker's own) must return the crashed shards once they run out.
    (only,) = cluster.workers_exactly(1, env={"BATCHINFER_LEASE_SECONDS": "8"})
    batch_id, ids = _submit(cluster, "restart", 16, max_tokens=160)
    cluster.wait_done(batch_id, 2)
    cluster.kill(only)
    killed_at = time.monotonic()
    cluster.workers_exactly(1)
    restarted_after = time.monotonic() - killed_at

    batch = cluster.wait_status(batch_id, {"completed", "failed"}, timeout=60)
    assert batch["status"] == "completed"
    assert time.monotonic() - killed_at < 8 + 1 + restarted_after + 20  # lease + rescue + restart + run
    _assert_all_succeeded_once(cluster, batch_id, ids)


def test_sigterm_mid_shard_keeps_results_and_hands_the_shard_to_the_other(cluster: Topology) -> None:
    workers = cluster.workers_exactly(2)
    batch_id, ids = _submit(cluster, "sigterm", 64, max_tokens=192)
    cluster.wait_done(batch_id, 4)
    leaving = cluster.holder_of_a_shard(workers)
    staying = next(name for name in workers if name != leaving)
    done_before = cluster.batch(batch_id)["request_counts"]["completed"]
    cluster.signal(leaving, signal.SIGTERM)
    # A warm shutdown: in-flight requests are aborted and the shards released, not run to the end.
    assert cluster.procs[leaving].wait(timeout=20) == 0, cluster.log(leaving)
    handed_back = cluster.shards_logged(leaving, "released")
    assert handed_back, f"{leaving} held a shard when it was told to stop\n{cluster.log(leaving)}"

    batch = cluster.wait_status(batch_id, {"completed", "failed"}, timeout=60)
    assert batch["status"] == "completed"
    assert batch["request_counts"]["completed"] >= done_before  # nothing finished was thrown away
    _assert_all_succeeded_once(cluster, batch_id, ids)
    assert handed_back <= cluster.shards_logged(staying, "completed"), (
        f"the shards {handed_back} handed back by {leaving} were finished by {staying}\n{cluster.logs()}")
