"""Streaming ingestion of a JSONL batch file into request rows, then shards.

One pass over the file in binary, line by line (never the whole file in memory):
  read (BOM on line 1, CRLF, oversized lines cut off) -> parse_line -> row tuple -> bulk insert every
  `chunk_rows` rows in its own committed transaction (SQLite: executemany of a compiled Core insert;
  PostgreSQL + psycopg: COPY, on a writer thread so parsing overlaps the server's work).
Each valid line also leaves (prefix key, line) in two flat arrays; make_shards sorts them once and
cuts shards of `shard_size`, so requests that share a prompt prefix run together (see models.py).

A bad line becomes an `errored` request row and a line-numbered entry in the job's errors; its
custom_id is its own when readable and unused, else "line-<n>" (NULL if even that is taken). A
duplicate custom_id is caught by UNIQUE(job_id, custom_id) itself, so memory is the chunks in flight
plus 12 bytes a line for the shard plan.
Blank lines inside the file are bad lines ("blank line"); blank lines at the very end are ignored.
Prompt length against the model's context is not checked here (it needs the tokenizer): the worker
errors such requests.
"""

from __future__ import annotations

import queue
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from zlib import crc32

import orjson
from sqlalchemy import Connection, Engine, insert, select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.formats import ENDPOINT_TO_URL, URL_TO_ENDPOINT, Endpoint, LineError, parse_line
from batchinfer.store.models import (
    LINE_BITS,
    Request,
    RequestStatus,
    Shard,
    ShardStatus,
    request_id_for,
    utcnow,
)

BOM = b"\xef\xbb\xbf"
MAX_LISTED_ERRORS = 100  # errors kept on the job; the rest are counted (each bad line still has its row)
PREFIX_LEVELS = ((64, 15), (256, 16), (1024, 16), (4096, 16))  # (prefix bytes, key bits) of prefix_key
_ROW_COLUMNS = ("id", "job_id", "line_number", "custom_id", "status", "endpoint", "payload", "error_code",
                "error_message")


@dataclass
class IngestLimits:
    """Input limits (defaults come from Settings)."""

    max_line_bytes: int = 1 << 20
    max_requests: int = 5_000_000
    max_metadata_bytes: int = 16 * 1024

    @classmethod
    def from_settings(cls, settings: Settings) -> IngestLimits:
        """The limits the settings configure (max_line_bytes, max_requests_per_job, max_metadata_bytes)."""
        return cls(settings.max_line_bytes, settings.max_requests_per_job, settings.max_metadata_bytes)


@dataclass
class IngestResult:
    """What one ingest found: counts, the first errors, and `fatal` when the file cannot run at all."""

    total: int = 0  # request rows written (valid + invalid lines)
    valid: int = 0
    invalid: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)  # [{code, message, line, param}]
    fatal: str | None = None
    # The shard plan: prefix key and line number of each valid line, in input order (12 bytes a line).
    keys: array = field(default_factory=lambda: array("Q"))
    lines: array = field(default_factory=lambda: array("I"))
    duplicate_lines: list[int] = field(default_factory=list)  # valid lines that lost their custom_id


def prefix_key(text: str) -> int:
    """A 63-bit sort key whose order keeps texts sharing a prefix (at 64/256/1024/4096 bytes) adjacent.

    Each level is a running CRC of a longer prefix (PREFIX_LEVELS), so two texts with the same first
    256 bytes share the key's top 31 bits and sort next to each other; equal keys keep input order.
    The finest level, 64 bytes, is about one 16-token KV block: shorter shared prefixes save nothing.
    """
    data = text[:4096].encode("utf-8", "surrogatepass")
    crc1 = crc32(data[:64])
    crc2 = crc32(data[64:256], crc1)
    crc3 = crc32(data[256:1024], crc2)
    crc4 = crc32(data[1024:4096], crc3)
    return (crc1 & 0x7FFF) << 48 | (crc2 & 0xFFFF) << 32 | (crc3 & 0xFFFF) << 16 | (crc4 & 0xFFFF)


def iter_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes, str | None]]:
    """Yield (line_number, content without newline, problem) with problem None, "blank" or "oversized ..."."""
    readline = stream.readline
    limit = max_line_bytes + 2  # room for "\r\n"
    line_number = 0
    blank_run: list[int] = []  # blank lines, reported only once a non-blank line follows
    while True:
        raw = readline(limit)
        if not raw:
            return
        line_number += 1
        if line_number == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if raw.endswith(b"\n"):
            content = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
        elif len(raw) < limit:
            content = raw  # last line, no newline
        else:
            size = len(raw) + _skip_rest_of_line(readline)
            yield from ((n, b"", "blank") for n in blank_run)
            blank_run.clear()
            yield line_number, b"", f"oversized line ({size} bytes; max_line_bytes is {max_line_bytes})"
            continue
        if not content or content.isspace():
            blank_run.append(line_number)
            continue
        if blank_run:
            yield from ((n, b"", "blank") for n in blank_run)
            blank_run.clear()
        if len(content) > max_line_bytes:
            yield (line_number, b"",
                   f"oversized line ({len(content)} bytes; max_line_bytes is {max_line_bytes})")
            continue
        yield line_number, content, None


def _skip_rest_of_line(readline: Any) -> int:
    skipped = 0
    while True:
        chunk = readline(1 << 16)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


class _ChunkWriter:
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
        self.duplicates: list[_Duplicate] = []
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
            self.duplicates += _insert_chunk(connection, rows, postgres_copy=self.postgres_copy)
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
class _Duplicate:
    """A line whose custom_id an earlier line of the job already used."""

    line_number: int
    was_valid: bool
    code: str
    message: str


def _insert_chunk(connection: Connection, rows: list[tuple], *, postgres_copy: bool) -> list[_Duplicate]:
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


def _reinsert_duplicate(connection: Connection, row: tuple) -> _Duplicate:
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
    return _Duplicate(line_number, was_valid, code, message)


def _copy(connection: Connection, rows: list[tuple]) -> None:
    columns = ", ".join(_ROW_COLUMNS)
    with connection.connection.driver_connection.cursor() as cursor, \
            cursor.copy(f"COPY {Request.__tablename__} ({columns}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def _insert_sql(dialect: Any) -> str:
    """INSERT ... ON CONFLICT DO NOTHING of a request row, compiled once per dialect to driver SQL."""
    cached = _INSERT_SQL.get(dialect.name)
    if cached is None:
        insert = {"sqlite": sqlite_insert, "postgresql": postgresql_insert}[dialect.name]
        statement = insert(Request.__table__).on_conflict_do_nothing()
        positional = type(dialect)(paramstyle="qmark" if dialect.name == "sqlite" else "format")
        compiled = statement.compile(dialect=positional, column_keys=list(_ROW_COLUMNS))
        assert tuple(compiled.positiontup or ()) == _ROW_COLUMNS, compiled
        cached = _INSERT_SQL[dialect.name] = str(compiled)
    return cached


_INSERT_SQL: dict[str, str] = {}
_ENDPOINT_VALUE = {endpoint: endpoint.value for endpoint in Endpoint}  # plain str for the drivers, quickly


def ingest_file(engine: Engine, *, job_id: int, stream: BinaryIO, limits: IngestLimits,
                endpoint: str | None = None, stop_after_errors: int | None = None,
                chunk_rows: int | None = None) -> IngestResult:
    """Stream `stream` into request rows of `job_id`, committing chunk by chunk. Shards are made separately.

    `endpoint`: the url every line must use (a batch created for one endpoint), or None for either.
    `stop_after_errors`: stop reading after that many bad lines (on_invalid="fail" needs no more).
    """
    required = URL_TO_ENDPOINT[endpoint] if endpoint is not None else None
    writer = _ChunkWriter(engine)
    chunk_rows = chunk_rows or (20_000 if writer.postgres_copy else 10_000)
    result = IngestResult()
    rows: list[tuple] = []
    queued = 0
    pending, errored, dumps = RequestStatus.PENDING.value, RequestStatus.ERRORED.value, orjson.dumps
    base_id = request_id_for(job_id, 0)
    add_key, add_line = result.keys.append, result.lines.append

    def bad(line_number: int, message: str, code: str, param: str | None, custom_id: str | None) -> None:
        result.invalid += 1
        message = f"line {line_number}: {message}"
        if len(result.errors) < MAX_LISTED_ERRORS:
            result.errors.append({"code": code, "message": message, "line": line_number, "param": param})
        rows.append((base_id | line_number, job_id, line_number, custom_id or f"line-{line_number}", errored,
                     None, None, code, message))

    try:
        for line_number, content, problem in iter_lines(stream, limits.max_line_bytes):
            if queued + len(rows) >= limits.max_requests or line_number >> LINE_BITS:
                result.fatal = (f"the file has more than {limits.max_requests} requests "
                                "(max_requests_per_job); split it into several files")
                break
            if problem is not None:
                bad(line_number, problem + ("; remove it" if problem == "blank" else ""),
                    "blank_line" if problem == "blank" else "line_too_long", None, None)
            else:
                try:
                    request = parse_line(content, line_number, max_metadata_bytes=limits.max_metadata_bytes)
                except LineError as exc:
                    bad(line_number, exc.message, exc.code, exc.param, exc.custom_id)
                else:
                    if required is None or request.endpoint is required:
                        rows.append((base_id | line_number, job_id, line_number, request.custom_id, pending,
                                     _ENDPOINT_VALUE[request.endpoint], dumps(request.payload()).decode(),
                                     None, None))
                        add_key(prefix_key(request.prefix_text()))
                        add_line(line_number)
                        result.valid += 1
                    else:
                        bad(line_number, f"url {ENDPOINT_TO_URL[request.endpoint]} does not match the batch "
                            f"endpoint {endpoint}; every line must use it", "invalid_url", "url",
                            request.custom_id)
            if stop_after_errors is not None and result.invalid >= stop_after_errors:
                break
            if len(rows) >= chunk_rows:
                writer.put(rows)
                queued, rows = queued + len(rows), []
        if rows:
            writer.put(rows)
    finally:
        result.total = writer.close()
    _count_duplicates(result, writer.duplicates)
    return result


def _count_duplicates(result: IngestResult, duplicates: list[_Duplicate]) -> None:
    """Fold the writer's duplicate lines into the counts and the (line-ordered) error list."""
    for duplicate in duplicates:
        if duplicate.was_valid:
            result.duplicate_lines.append(duplicate.line_number)
            result.valid -= 1
            result.invalid += 1
            result.errors.append({"code": duplicate.code, "message": duplicate.message,
                                  "line": duplicate.line_number, "param": "custom_id"})
    result.errors.sort(key=lambda error: error["line"])
    del result.errors[MAX_LISTED_ERRORS:]


def make_shards(session: Session, *, job_id: int, result: IngestResult, shard_size: int, model: str,
                priority: int, max_attempts: int) -> int:
    """Cut the job's valid requests into shards of `shard_size` in (prefix key, line) order; returns how many.

    A stable argsort of the keys collected at ingest (lines are already ascending, so ties keep input
    order). Runs in the caller's transaction (no commit).
    """
    import numpy as np

    keys = np.frombuffer(result.keys, dtype=np.uint64)
    lines = np.frombuffer(result.lines, dtype=np.uint32)
    if result.duplicate_lines:
        keep = ~np.isin(lines, np.asarray(result.duplicate_lines, dtype=np.uint32))
        keys, lines = keys[keep], lines[keep]
    if len(lines) != result.valid:
        raise RuntimeError(f"job {job_id}: shard plan has {len(lines)} lines, expected {result.valid}")
    ordered = lines[np.argsort(keys, kind="stable")].astype("<u4")
    now = utcnow()
    shards = [{"job_id": job_id, "ordinal": ordinal, "model": model, "priority": priority,
               "status": ShardStatus.AVAILABLE.value, "num_requests": len(part),
               "request_lines": part.tobytes(), "attempt": 0, "max_attempts": max_attempts, "created_at": now}
              for ordinal, part in enumerate(ordered[start:start + shard_size]
                                             for start in range(0, len(ordered), shard_size))]
    for start in range(0, len(shards), 1000):
        session.execute(insert(Shard), shards[start:start + 1000])
    return len(shards)
