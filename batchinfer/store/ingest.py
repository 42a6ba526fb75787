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

import logging
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO
from zlib import crc32

from sqlalchemy import Engine, insert
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.engine.sampling.grammars import DEFAULT_GRAMMAR_BUDGET, GrammarBudget
from batchinfer.store.ingest_writer import ChunkWriter, Duplicate
from batchinfer.store.line_models import ModelRouting
from batchinfer.store.models import (
    LINE_BITS,
    RequestStatus,
    Shard,
    ShardStatus,
    request_id_for,
    utcnow,
)
from batchinfer.wire.budget import RequestBudget
from batchinfer.wire.input_line import parse_line
from batchinfer.wire.request import (
    ENDPOINT_TO_URL,
    URL_TO_ENDPOINT,
    Endpoint,
    LineError,
    LineErrorEntry,
    encode_stored,
)

logger = logging.getLogger(__name__)
BOM = b"\xef\xbb\xbf"
MAX_LISTED_ERRORS = 100  # errors kept on the job; the rest are counted (each bad line still has its row)
PREFIX_LEVELS = ((64, 15), (256, 16), (1024, 16), (4096, 16))  # (prefix bytes, key bits) of prefix_key


@dataclass
class IngestLimits:
    """Input limits (defaults come from Settings)."""

    max_line_bytes: int = 1 << 20
    max_requests: int = 5_000_000
    max_metadata_bytes: int = 16 * 1024
    chunk_bytes: int = 8 << 20  # a chunk commits at this many input bytes (or chunk_rows rows): flat RSS
    budget: RequestBudget | None = None  # per-request resource bounds (wire/budget.py); None: unchecked
    constraint_budget: GrammarBudget = DEFAULT_GRAMMAR_BUDGET  # structured output's depth, size, time

    @classmethod
    def from_settings(cls, settings: Settings, model: str | None = None) -> IngestLimits:
        """The limits the settings configure for a job of `model` (max_line_bytes ... the request budget)."""
        return cls(settings.max_line_bytes, settings.max_requests_per_job, settings.max_metadata_bytes,
                   settings.ingest_chunk_bytes, RequestBudget.from_settings(settings, model),
                   GrammarBudget.from_settings(settings))


@dataclass
class IngestResult:
    """What one ingest found: counts, the first errors, and `fatal` when the file cannot run at all."""

    total: int = 0  # request rows written (valid + invalid lines)
    valid: int = 0
    invalid: int = 0
    errors: list[LineErrorEntry] = field(default_factory=list)
    fatal: str | None = None
    # The shard plan: prefix key and line number of each valid line, in input order (12 bytes a line).
    keys: array = field(default_factory=lambda: array("Q"))
    lines: array = field(default_factory=lambda: array("I"))
    duplicate_lines: list[int] = field(default_factory=list)  # valid lines that lost their custom_id
    # For the estimate made at submit (store.estimate.from_counts): the valid lines' caps (n x max_tokens)
    # added up, and the generation lines without max_tokens (their cap depends on the prompt's length).
    max_output_tokens: int = 0
    uncapped: int = 0


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


def _skip_rest_of_line(readline: Callable[[int], bytes]) -> int:
    skipped = 0
    while True:
        chunk = readline(1 << 16)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


_ENDPOINT_VALUE = {endpoint: endpoint.value for endpoint in Endpoint}  # plain str for the drivers, quickly


def ingest_file(engine: Engine, *, job_id: int, stream: BinaryIO, limits: IngestLimits,
                endpoint: str | None = None, stop_after_errors: int | None = None,
                chunk_rows: int | None = None, check_lease: Callable[[], None] | None = None,
                routing: ModelRouting | None = None) -> IngestResult:
    """Stream `stream` into request rows of `job_id`, committing chunk by chunk. Shards are made separately.

    `endpoint`: the url every line must use (a batch created for one endpoint), or None for either.
    `stop_after_errors`: stop reading after that many bad lines (on_invalid="fail" needs no more).
    `check_lease`: called before each chunk; raises to stop a submit whose lease is lost (ingest_lease.py).
    """
    required = URL_TO_ENDPOINT[endpoint] if endpoint is not None else None
    writer = ChunkWriter(engine)
    chunk_rows = chunk_rows or (20_000 if writer.postgres_copy else 10_000)
    result = IngestResult()
    rows: list[tuple] = []
    queued = chunk_bytes = 0
    pending, errored = RequestStatus.PENDING.value, RequestStatus.ERRORED.value
    base_id = request_id_for(job_id, 0)
    add_key, add_line = result.keys.append, result.lines.append

    def bad(line_number: int, message: str, code: str, param: str | None, custom_id: str | None) -> None:
        result.invalid += 1
        # Field names are quoted as written, except NUL (PostgreSQL text cannot hold it), spelled \x00.
        message = f"line {line_number}: {message}".replace("\x00", "\\x00")
        param = param.replace("\x00", "\\x00") if param else param
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
                    request = parse_line(content, line_number, max_metadata_bytes=limits.max_metadata_bytes,
                                         constraint_budget=limits.constraint_budget)
                    if limits.budget is not None:
                        limits.budget.check(request)
                    if routing is not None and request.model is not None:
                        routing.route(request.model, line_number,  # model_not_found: line_models.py
                                      custom_id=request.custom_id)
                    if required is not None and request.endpoint is not required:
                        raise LineError(f"url {ENDPOINT_TO_URL[request.endpoint]} does not match the batch "
                                        f"endpoint {endpoint}; every line must use it", code="invalid_url",
                                        param="url", custom_id=request.custom_id)
                    row = (base_id | line_number, job_id, line_number, request.custom_id, pending,
                           _ENDPOINT_VALUE[request.endpoint], encode_stored(request), None, None)
                    key = prefix_key(request.prefix_text())
                except LineError as exc:
                    bad(line_number, exc.message, exc.code, exc.param, exc.custom_id)
                except Exception as exc:  # noqa: BLE001 - whatever a line does, it costs that line only
                    logger.warning("line %d: unexpected %s while reading it", line_number, type(exc).__name__,
                                   exc_info=True)
                    bad(line_number, f"could not be read ({type(exc).__name__}: {str(exc)[:200]}); check "
                        "the line's JSON against the README's input format", "invalid_request", None, None)
                else:
                    rows.append(row)
                    add_key(key)
                    add_line(line_number)
                    result.valid += 1
                    if request.endpoint is not Endpoint.EMBEDDINGS:
                        if request.params.max_tokens is None:
                            result.uncapped += 1
                        else:
                            result.max_output_tokens += request.params.n * request.params.max_tokens
            if stop_after_errors is not None and result.invalid >= stop_after_errors:
                break
            chunk_bytes += len(content)
            if len(rows) >= chunk_rows or chunk_bytes >= limits.chunk_bytes:
                if check_lease is not None:
                    check_lease()
                writer.put(rows)
                queued, rows, chunk_bytes = queued + len(rows), [], 0
        if rows:
            writer.put(rows)
    finally:
        result.total = writer.close()
    _count_duplicates(result, writer.duplicates)
    return result


def _count_duplicates(result: IngestResult, duplicates: list[Duplicate]) -> None:
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
                priority: int, max_attempts: int, routing: ModelRouting | None = None) -> int:
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
    groups = [(model, ordered)] if routing is None else routing.split(ordered)  # shards are per model
    shards = [{"job_id": job_id, "ordinal": ordinal, "model": name, "priority": priority,
               "status": ShardStatus.AVAILABLE.value, "num_requests": len(part),
               "request_lines": part.tobytes(), "attempt": 0, "max_attempts": max_attempts, "created_at": now}
              for ordinal, (name, part) in enumerate((name, group[start:start + shard_size])
                                                     for name, group in groups
                                                     for start in range(0, len(group), shard_size))]
    for start in range(0, len(shards), 1000):
        session.execute(insert(Shard), shards[start:start + 1000])
    return len(shards)
