"""Promise 6: the broker and the database may restart mid-job; the job completes and nothing is lost.

Both servers are private to the test (a redis-server and an initdb'd PostgreSQL cluster on free ports), so
restarting them touches nothing else on the machine. Redis runs without persistence: its restart drops
every queued message, and the periodic rescue's wake-ups must make up for them. The PostgreSQL restart
(fast shutdown) cuts every open connection of the API, beat and the workers mid-write.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.servers import PostgresCluster, RedisServer
from tests.acceptance.topology import Topology, custom_ids, write_chat_requests

pytestmark = [pytest.mark.acceptance, pytest.mark.redis]
Servers = tuple[PostgresCluster, RedisServer]


@pytest.fixture
def private_servers(redis_binary: None, tmp_path: Path) -> Iterator[Servers]:
    """A private PostgreSQL cluster and a private Redis (skipped with the reason if PostgreSQL cannot run)."""
    try:
        postgres = PostgresCluster()
    except RuntimeError as exc:
        pytest.skip(f"cannot start a private PostgreSQL cluster: {exc}")
    try:
        postgres.init()
    except (RuntimeError, OSError, LookupError) as exc:  # no `postgres` user, initdb refused
        postgres.stop()
        pytest.skip(f"cannot start a private PostgreSQL cluster: {exc}")
    redis = RedisServer(tmp_path)
    try:
        redis.start()
        yield postgres, redis
    finally:
        redis.stop()
        postgres.stop()


def test_redis_and_postgres_restarts_mid_job_lose_nothing(private_servers: Servers, tiny_llama: Path,
                                                          tmp_path: Path) -> None:
    postgres, redis = private_servers
    topology = Topology(tmp_path, database_url=postgres.url, model=tiny_llama, broker_url=redis.url)
    try:
        topology.start_api()
        topology.start_beat(wait=False)
        topology.workers_exactly(2)
        topology.wait_beat()
        path = tmp_path / "restarts.jsonl"
        ids = write_chat_requests(path, 64, max_tokens=256, prefix="restarts")
        batch_id = topology.cli_json("submit", str(path), remote=True)[0]["id"]
        topology.wait_done(batch_id, 4)

        redis.stop()  # every queued announcement is gone
        redis.start()
        done = topology.batch(batch_id)["request_counts"]["completed"]
        assert done < len(ids), "the job ended before the broker restart: make it longer"
        topology.wait_done(batch_id, done + 4)

        postgres.restart()  # every connection is cut, some of them mid-transaction
        batch = topology.wait_status(batch_id, {"completed", "failed", "expired"}, timeout=120)
        assert batch["status"] == "completed", topology.logs()
        assert batch["request_counts"] == {"total": len(ids), "completed": len(ids), "failed": 0}
        output, errors = topology.results(batch_id)
        assert custom_ids(output) == ids and errors == []  # nothing lost, nothing twice
        assert all(line["response"]["status_code"] == 200 for line in output)
        for name, proc in topology.procs.items():
            assert proc.poll() is None, f"{name} did not survive the restarts\n{topology.log(name)}"
    finally:
        topology.stop()
        topology.rest.close()
