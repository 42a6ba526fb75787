"""Promise 8: the kill -9 story without a broker: SQLite, two polling `batchinfer worker`s (and the API).

The workers' own duty threads rescue expired leases (there is no beat in this shape), so the shard of
a worker killed mid-job returns to the queue and the other worker finishes it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.acceptance.topology import Topology, custom_ids, write_chat_requests

pytestmark = pytest.mark.acceptance


def test_kill_9_one_of_two_local_workers_on_sqlite(tiny_llama: Path, tmp_path: Path) -> None:
    topology = Topology(tmp_path, database_url=f"sqlite:///{tmp_path / 'batchinfer.db'}", model=tiny_llama)
    try:
        topology.start_api()
        workers = topology.workers_exactly(2)
        path = tmp_path / "local.jsonl"
        ids = write_chat_requests(path, 64, max_tokens=192, prefix="local")
        batch_id = topology.cli_json("submit", str(path))[0]["id"]  # no --server: straight into SQLite
        topology.wait_done(batch_id, 4)
        victim = topology.holder_of_a_shard(workers)
        topology.kill(victim)
        killed_at = time.monotonic()

        batch = topology.wait_status(batch_id, {"completed", "failed"}, timeout=60)
        assert batch["status"] == "completed", topology.logs()
        assert time.monotonic() - killed_at < 60
        output, errors = topology.results(batch_id)
        assert custom_ids(output) == ids and errors == []  # every custom_id exactly once
        assert all(line["response"]["status_code"] == 200 for line in output)
    finally:
        topology.stop()
        topology.rest.close()
