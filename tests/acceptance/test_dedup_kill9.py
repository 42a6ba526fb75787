"""Dedup within a job across shards of two workers, under kill -9 (issue 31): a duplicate-heavy job on two
polling `batchinfer worker` processes (SQLite and PostgreSQL), one killed mid-job; the other finishes it,
every custom_id exactly once, identical lines equal."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from batchinfer.store.db import get_engine, upgrade
from tests.acceptance.topology import Topology, custom_ids

pytestmark = pytest.mark.acceptance
DISTINCT = 256  # distinct prompts; each appears twice


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_kill_9_mid_fan_out_keeps_every_custom_id_exactly_once(
        database: str, tiny_llama: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = f"sqlite:///{tmp_path / 'batchinfer.db'}"
    if database == "postgres":
        url = request.getfixturevalue("pg_url")
        upgrade(url)
    topology = Topology(tmp_path, database_url=url, model=tiny_llama)
    try:
        topology.start_api()
        workers = topology.workers_exactly(2)
        path = tmp_path / "dups.jsonl"
        # 256 distinct greedy prompts x 2 custom_ids, twins 64 shards apart: long enough (~8 s of two
        # workers on the native step) that a worker still holds a shard when the kill comes
        ids = [f"dup-{i:03d}" for i in range(2 * DISTINCT)]
        with path.open("wb") as out:
            for i, custom_id in enumerate(ids):
                prompt = f"the cat reads the prompt number {i % DISTINCT}"
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 192,
                        "ignore_eos": True, "temperature": 0}
                out.write(orjson.dumps({"custom_id": custom_id, "method": "POST",
                                        "url": "/v1/chat/completions", "body": body}) + b"\n")
        batch_id = topology.cli_json("submit", str(path))[0]["id"]
        topology.wait_done(batch_id, 4)
        victim = topology.holder_of_a_shard(workers)
        topology.kill(victim)
        killed_at = time.monotonic()

        batch = topology.wait_status(batch_id, {"completed", "failed"}, timeout=90)
        assert batch["status"] == "completed", topology.logs()
        assert time.monotonic() - killed_at < 90
        output, errors = topology.results(batch_id)
        assert sorted(custom_ids(output)) == ids and errors == []  # every custom_id exactly once
        sources = Counter(line["provenance"]["result_cache"] for line in output)
        assert sources["dedup"] > 0 and sources["miss"] + sources["dedup"] == 2 * DISTINCT
        by_prompt: dict[int, set[bytes]] = {}
        for line in output:
            prompt = int(line["custom_id"].split("-")[1]) % DISTINCT
            by_prompt.setdefault(prompt, set()).add(orjson.dumps(line["response"]["body"]["choices"]))
        assert all(len(bodies) == 1 for bodies in by_prompt.values())  # twins equal, whoever computed them
    finally:
        topology.stop()
        topology.rest.close()
        get_engine(url).dispose()  # let pg_url drop its database
