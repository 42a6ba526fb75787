"""The ingest's row writer: request-row chunks into the database, each chunk its own transaction.

ingest.py parses and decides; this module only writes (COPY on PostgreSQL + psycopg, a compiled
ON CONFLICT DO NOTHING insert elsewhere) and turns custom_id collisions into error rows.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from sqlalchemy import Connection, Dialect, Engine, Insert, Table, select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from batchinfer.store.models import Request, RequestStatus

if TYPE_CHECKING:
    from sqlalchemy.engine.default import DefaultDialect

_ROW_COLUMNS = ("id", "job_id", "line_number", "custom_id", "status", "endpoint", "payload", "error_code",
                "error_message")


class ChunkWriter:
    """Writes row chunks, each in its own committed transaction, on its own connection.

    PostgreSQL: on a background thread, so parsing (Python) overlaps COPY (the server's work, in
    another process; psycopg releases the GIL while it waits). At most two chunks wait in the queue.
    SQLite: inline; its work runs in this process and a second thread only convoys on the GIL.
    Rows whose custom_id is already taken become error rows (see _insert_chunk), listed in `duplicates`.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.postgres_copy = engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"
        self.rows_written = 0
        self.duplicates: list[Duplicate] = []
        self.error: BaseException | None = None
        self.queue: queue.Queue[list[tuple] | None] = queue.Queue(maxsize=2)
        self.thread: threading.Thread | None = None
        if self.postgres_copy:
            self.thread = threading.Thread(target=self._run, name="ingest-writer", daemon=True)
            self.thread.start()
        else:
            self.connection = engine.connect()
            # Checkpoint the WAL every ~40 MB instead of every 4 MB while streaming (fewer fsyncs and copies).
            self.connection.exec_driver_sql(f"PRAGMA wal_autocheckpoint={_INGEST_WAL_PAGES}")
            self.connection.commit()

    def put(self, rows: list[tuple]) -> None:
        """Write (or queue) one chunk."""
        if self.thread is None:
            self._write(self.connection, rows)
            return
        if self.error is not None:
            raise self.error
        self.queue.put(rows)

    def close(self) -> int:
        """Wait for every chunk; returns the rows written (re-raises the writer's error)."""
        if self.thread is None:
            self.connection.exec_driver_sql(f"PRAGMA wal_autocheckpoint={_DEFAULT_WAL_PAGES}")
            self.connection.commit()
            self.connection.close()
            return self.rows_written
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.rows_written

    def _write(self, connection: Connection, rows: list[tuple]) -> None:
        with connection.begin():
            self.duplicates += insert_chunk(connection, rows, postgres_copy=self.postgres_copy)
        self.rows_written += len(rows)

    def _run(self) -> None:
        try:
            with self.engine.connect() as connection:
                while (rows := self.queue.get()) is not None:
                    self._write(connection, rows)
        except BaseException as exc:  # handed to the parser thread at its next put/close
            self.error = exc
            while self.queue.get() is not None:  # unblock the producer until it closes
                pass


_INGEST_WAL_PAGES, _DEFAULT_WAL_PAGES = 10_000, 1000


@dataclass
class Duplicate:
    """A line whose custom_id an earlier line of the job already used."""

    line_number: int
    was_valid: bool
    code: str
    message: str


def insert_chunk(connection: Connection, rows: list[tuple], *, postgres_copy: bool) -> list[Duplicate]:
    """Insert request rows (sorted by line, columns _ROW_COLUMNS) in the connection's transaction.

    UNIQUE(job_id, custom_id) is the duplicate detector, so ingest keeps no set of ids in memory:
    SQLite inserts with ON CONFLICT DO NOTHING; PostgreSQL tries COPY and, only if a custom_id
    collides, redoes the chunk with INSERT ... ON CONFLICT DO NOTHING. The rows that did not go in
    are re-inserted as error rows naming the line that used the id first.
    """
    if postgres_copy:
        try:
            with connection.begin_nested():
                _copy(connection, rows)
            return []
        except Exception as exc:
            if getattr(exc, "sqlstate", None) != "23505":  # unique_violation: retry row by row below
                raise
    result = connection.exec_driver_sql(_insert_sql(connection.dialect), rows)
    if result.rowcount == len(rows):
        return []
    first, last = rows[0][0], rows[-1][0]
    stored = set(connection.scalars(select(Request.id).where(Request.id >= first, Request.id <= last)))
    return [_reinsert_duplicate(connection, row) for row in rows if row[0] not in stored]


def _reinsert_duplicate(connection: Connection, row: tuple) -> Duplicate:
    request_id, job_id, line_number, custom_id, status = row[:5]
    earlier = connection.scalar(select(Request.line_number).where(Request.job_id == job_id,
                                                                  Request.custom_id == custom_id))
    was_valid = status == RequestStatus.PENDING
    if was_valid:
        code = "duplicate_custom_id"
        message = (f"line {line_number}: duplicate custom_id {custom_id!r} (first used on line {earlier}); "
                   "custom_ids must be unique within a file")
    else:  # a bad line whose own custom_id is taken: it keeps its error, under another id
        code, message = row[7], row[8]
    for fallback in (f"line-{line_number}", None):
        error_row = (request_id, job_id, line_number, fallback, RequestStatus.ERRORED.value, None, None, code,
                     message)
        if connection.exec_driver_sql(_insert_sql(connection.dialect), error_row).rowcount == 1:
            break
    return Duplicate(line_number, was_valid, code, message)


def _copy(connection: Connection, rows: list[tuple]) -> None:
    columns = ", ".join(_ROW_COLUMNS)
    driver = connection.connection.driver_connection  # psycopg's: COPY is PostgreSQL's
    if driver is None:
        raise RuntimeError("the connection is closed")
    with driver.cursor() as cursor, \
            cursor.copy(f"COPY {Request.__tablename__} ({columns}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def _insert_sql(dialect: Dialect) -> str:
    """INSERT ... ON CONFLICT DO NOTHING of a request row, compiled once per dialect to driver SQL."""
    cached = _INSERT_SQL.get(dialect.name)
    if cached is None:
        table = Request.__table__
        if not isinstance(table, Table):
            raise TypeError(f"{Request.__name__}.__table__ is not a Table")
        if dialect.name == "sqlite":
            statement: Insert = sqlite_insert(table).on_conflict_do_nothing()
        else:
            statement = postgresql_insert(table).on_conflict_do_nothing()
        # every concrete dialect is a DefaultDialect, whose constructor takes the paramstyle
        dialect_class = cast("type[DefaultDialect]", type(dialect))
        positional = dialect_class(paramstyle="qmark" if dialect.name == "sqlite" else "format")
        compiled = statement.compile(dialect=positional, column_keys=list(_ROW_COLUMNS))
        assert tuple(compiled.positiontup or ()) == _ROW_COLUMNS, compiled
        cached = _INSERT_SQL[dialect.name] = str(compiled)
    return cached


_INSERT_SQL: dict[str, str] = {}
