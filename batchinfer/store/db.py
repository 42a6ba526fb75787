"""Database engine and session factory, SQLite tuning, programmatic migrations.

SQLite is the embedded default (local mode), PostgreSQL the production database. Both run the
same statements; the differences live here and in a few `is_sqlite(...)` branches:

- SQLite connections get WAL (readers never block the writer), busy_timeout (a writer waits for
  the lock instead of failing), synchronous=NORMAL (durable at checkpoint, fast commits) and
  foreign_keys=ON. SQLAlchemy, not the sqlite3 driver, emits BEGIN, so every transaction is a real
  one (reads included) and a write transaction can ask for `BEGIN IMMEDIATE`: it takes the write
  lock up front, so two writers queue on busy_timeout instead of one failing with SQLITE_BUSY when
  it upgrades a read snapshot that went stale.
- PostgreSQL write paths lock rows (`FOR UPDATE`, `SKIP LOCKED`) instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Result, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
_BEGIN_MODE_OPTION = "batchinfer_sqlite_begin"  # connection execution option read by the "begin" hook
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def normalize_url(url: str) -> str:
    """Pick our drivers: `postgresql://` means psycopg 3 (COPY support), not psycopg2."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def is_sqlite(bind: Engine | Session) -> bool:
    """True when the engine (or the session's engine) talks to SQLite."""
    engine = bind.get_bind() if isinstance(bind, Session) else bind
    return engine.dialect.name == "sqlite"


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """Create an engine for `url` with our SQLite pragmas and transaction hooks installed."""
    url = normalize_url(url)
    if make_url(url).get_backend_name() != "sqlite":
        return create_engine(url, echo=echo, pool_pre_ping=True, future=True)

    engine = create_engine(url, echo=echo, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _sqlite_connect(dbapi_connection, _record):  # noqa: ANN001
        dbapi_connection.isolation_level = None  # the driver stays out of transaction control
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA cache_size=-65536")  # 64 MiB page cache: random index inserts at ingest
        cursor.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn):  # noqa: ANN001
        mode = conn.get_execution_options().get(_BEGIN_MODE_OPTION, "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


@lru_cache(maxsize=16)
def get_engine(url: str) -> Engine:
    """One engine (and connection pool) per URL per process."""
    return make_engine(url)


def session_factory(url_or_engine: str | Engine) -> sessionmaker[Session]:
    """A sessionmaker bound to the URL's engine; objects stay readable after commit."""
    engine = get_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextlib.contextmanager
def write_transaction(session: Session) -> Iterator[Session]:
    """Run the block as one write transaction and commit it (rollback on error).

    On SQLite the transaction starts with `BEGIN IMMEDIATE`. A transaction the session already has
    open (usually an autobegun read) is committed first, so the write starts on a fresh snapshot.
    """
    if session.in_transaction():
        session.commit()
    if is_sqlite(session):
        session.connection(execution_options={_BEGIN_MODE_OPTION: "IMMEDIATE"})
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise


def single_flight(session: Session, key: int) -> bool:
    """Inside a write transaction: may this one run the duty `key`? (One at a time across processes.)

    PostgreSQL: it takes the transaction-scoped advisory lock `key` if free (a second caller gets False
    at once and skips the pass); SQLite: always True, BEGIN IMMEDIATE already runs writers one by one.
    """
    if is_sqlite(session):
        return True
    return bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": key}))


@contextlib.contextmanager
def exclusive(url: str, key: int) -> Iterator[bool]:
    """Hold a lock named `key` across processes for the block; yields False at once if another holds it.

    For a duty spanning many transactions (a schedule tick). PostgreSQL: a session advisory lock, held
    by a connection of its own (it goes with the connection if the process dies). SQLite lives on one
    host: an flock on a file beside the database does the same.
    """
    parsed = make_url(normalize_url(url))
    if parsed.get_backend_name() != "sqlite":
        with get_engine(url).connect() as connection:
            held = bool(connection.scalar(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}))
            connection.commit()
            try:
                yield held
            finally:
                if held:
                    connection.scalar(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                    connection.commit()
        return
    import fcntl

    database = parsed.database or ""
    path = Path(database + f".lock-{key:x}") if database and database != ":memory:" else None
    if path is None:  # an in-memory database is one process's
        yield True
        return
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def end_transaction(session: Session) -> None:
    """Close the session's open transaction (a read, usually), so the next statement sees fresh data.

    Service functions call it before returning: on SQLite a transaction pins a snapshot, and a
    long-lived session that kept one open would never see other processes' commits.
    """
    if session.in_transaction():
        session.commit()


def ping(session: Session) -> None:
    """One trivial round trip (readiness probes); raises SQLAlchemyError when the database is unreachable."""
    session.execute(text("SELECT 1"))
    end_transaction(session)


def alembic_config(url: str):  # noqa: ANN201 - alembic is imported lazily
    """An alembic Config for our migrations directory, pointed at `url`."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Run the alembic migrations on `url` up to `revision` (creates the schema on a new database)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (Session.execute is typed as Result; DML gives a CursorResult)."""
    return cast(CursorResult[Any], result).rowcount
