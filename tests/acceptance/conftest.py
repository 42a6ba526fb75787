"""Fixtures of the acceptance suite: the production topology (PostgreSQL + a private Redis + `batchinfer api`
+ `batchinfer beat`) started once per module, and the workers each test starts on top of it.

Skips happen only when a server binary is really missing (redis-server; the machine's PostgreSQL is
found the way tests/conftest.py finds it, and a set BATCHINFER_TEST_POSTGRES_URL must answer).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.acceptance.servers import RedisServer
from tests.acceptance.topology import Topology


@pytest.fixture(scope="session")
def redis_binary() -> None:
    """Skip when redis-server is not installed (the suite starts private Redis servers)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed; the acceptance suite starts its own Redis")


@pytest.fixture(scope="module")
def fresh_pg_database(_postgres_server: str) -> Iterator[str]:
    """A new database on the machine's PostgreSQL server (CREATE DATABASE), dropped after the module."""
    name = f"bi_accept_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(_postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(_postgres_server).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def production(redis_binary: None, fresh_pg_database: str, tiny_llama: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """PostgreSQL + a private Redis + `batchinfer api` + `batchinfer beat`; tests add their workers."""
    tmp = tmp_path_factory.mktemp("production")
    redis = RedisServer(tmp)
    redis.start()
    topology = Topology(tmp, database_url=fresh_pg_database, model=tiny_llama, broker_url=redis.url)
    try:
        topology.start_api()  # it migrates the new database before it answers
        topology.start_beat(wait=False)  # starts while the workers load their engines
        topology.workers_exactly(2)
        topology.wait_beat()
        yield topology
    finally:
        topology.stop()
        topology.rest.close()
        redis.stop()


@pytest.fixture
def cluster(production: Topology) -> Iterator[Topology]:
    """The production topology (a test asks for its workers with `workers_exactly`); batches a failed test
    left running are cancelled after it."""
    try:
        yield production
    finally:
        production.cancel_unfinished()
