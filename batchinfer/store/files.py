"""Uploaded input files: streamed to disk under a size limit, registered as File rows, listed, deleted.

An upload is written chunk by chunk to `<data_dir>/files/.upload-<pid>-<random>.tmp` (never held in
memory), checked on the way (size limit, the owner's storage left, first line is a JSON object), then
renamed to `file-<id>.jsonl` once its row has an id. A failed upload leaves nothing behind; one whose
process was killed is removed by the next API start (`remove_stale_uploads`). Its bytes are charged to
the owner's stored bytes with its row, and given back with it (store.quotas). Output and error files
are not stored: they are generated from the database when read (see batchinfer.store.serialize).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session

from batchinfer.store.db import write_transaction
from batchinfer.store.ids import MAX_FILE_ID, is_file_id
from batchinfer.store.models import File, utcnow
from batchinfer.store.quotas import QuotaExceeded, charge_storage, charge_upload

FILES_SUBDIR = "files"
UPLOAD_PURPOSES = ("batch",)
_BOM = b"\xef\xbb\xbf"
_STAGED = re.compile(r"\.upload-(\d+)-[0-9a-f]+\.tmp")  # .upload-<pid of the writing process>-<random>.tmp


class FileTooLarge(ValueError):
    """The upload exceeded the size limit."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"file is larger than the limit of {max_bytes} bytes (settings.max_upload_bytes)")
        self.max_bytes = max_bytes


class InvalidFile(ValueError):
    """The upload is not a usable JSONL file (empty, or its first line is not a JSON object); `line`: the
    input line at fault, as data (None: the whole file)."""

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


def files_dir(data_dir: str | Path) -> Path:
    """Where uploaded files live."""
    return Path(data_dir) / FILES_SUBDIR


class UploadWriter:
    """Writes an upload to a temp file: enforces the size limit and checks the first line is JSON."""

    def __init__(self, data_dir: str | Path, *, max_bytes: int, max_line_bytes: int = 1 << 20,
                 quota_left: int | None = None, quota: int | None = None) -> None:
        self.directory = files_dir(data_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tmp_path = self.directory / f".upload-{os.getpid()}-{uuid.uuid4().hex}.tmp"
        self.max_bytes = max_bytes
        self.max_line_bytes = max_line_bytes
        self.quota_left, self.quota = quota_left, quota  # the owner's storage left (None: no quota)
        self.size = 0
        self.lines = 0  # newlines so far (+1 at finish for an unended last line): at most its requests
        self._last = b"\n"
        self._head = b""  # bytes of the first non-blank line while it is incomplete
        self._head_checked = False
        self._fh = self.tmp_path.open("wb")

    def write(self, chunk: bytes) -> None:
        """Append a chunk; raises FileTooLarge / InvalidFile (the temp file is removed then)."""
        if not chunk:
            return
        self.size += len(chunk)
        self.lines += chunk.count(b"\n")
        self._last = chunk[-1:]
        try:
            if self.size > self.max_bytes:
                raise FileTooLarge(self.max_bytes)
            if self.quota_left is not None and self.size > self.quota_left:  # stop before more lands
                raise QuotaExceeded(f"Storage quota exceeded: this upload passed the {self.quota_left} "
                                    f"bytes left of your {self.quota} (max_owner_stored_bytes); nothing "
                                    "was stored. Delete files or batches' output files you no longer "
                                    "need.", setting="max_owner_stored_bytes")
            if not self._head_checked:
                self._check_head(chunk)
            self._fh.write(chunk)
        except BaseException:
            self.abort()
            raise

    def _check_head(self, chunk: bytes) -> None:
        self._head = (self._head + chunk).lstrip(b" \t\r\n")
        if self._head.startswith(_BOM):
            self._head = self._head[len(_BOM):].lstrip(b" \t\r\n")
        end = self._head.find(b"\n")
        if end < 0:
            if len(self._head) > self.max_line_bytes:
                raise InvalidFile(f"line 1 is longer than {self.max_line_bytes} bytes "
                                  "(settings.max_line_bytes)", line=1)
            return
        _check_json_object(self._head[:end])
        self._head_checked = True
        self._head = b""

    def finish(self) -> tuple[Path, int, int]:
        """Close the temp file after the last chunk; returns (temp path, size, lines)."""
        try:
            if not self._head_checked:
                if not self._head.strip():
                    raise InvalidFile("file is empty: upload a JSONL file with one request object per line")
                _check_json_object(self._head)
            self._fh.close()
        except BaseException:
            self.abort()
            raise
        return self.tmp_path, self.size, self.lines + (self._last != b"\n")

    def abort(self) -> None:
        """Drop the temp file."""
        with contextlib.suppress(OSError):
            self._fh.close()
        with contextlib.suppress(OSError):
            self.tmp_path.unlink()


def _check_json_object(line: bytes) -> None:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise InvalidFile(
            f"file is not JSONL: line 1 is not valid JSON ({exc.msg}); put one JSON object per line", line=1
        ) from None
    if not isinstance(value, dict):
        raise InvalidFile(
            f"file is not JSONL: line 1 is a JSON {type(value).__name__}, not an object; "
            "put one request object per line", line=1
        )


@dataclass(frozen=True, slots=True)
class StagedUpload:
    """An upload written to its temp file and checked, waiting for its File row."""

    tmp_path: Path
    size: int
    lines: int = 0  # newline-separated lines, blank ones included: what a batch of it may reserve


def stage_upload(chunks: Iterable[bytes], *, data_dir: str | Path, max_bytes: int,
                 max_line_bytes: int = 1 << 20) -> StagedUpload:
    """Write a sync stream of chunks to a temp file under the limits."""
    writer = UploadWriter(data_dir, max_bytes=max_bytes, max_line_bytes=max_line_bytes)
    try:
        for chunk in chunks:
            writer.write(chunk)
    except BaseException:
        writer.abort()
        raise
    return StagedUpload(*writer.finish())


async def stage_upload_async(chunks: AsyncIterable[bytes], *, data_dir: str | Path, max_bytes: int,
                             max_line_bytes: int = 1 << 20) -> StagedUpload:
    """Write an async stream of chunks to a temp file under the limits."""
    writer = UploadWriter(data_dir, max_bytes=max_bytes, max_line_bytes=max_line_bytes)
    try:
        async for chunk in chunks:
            writer.write(chunk)
    except BaseException:
        writer.abort()
        raise
    return StagedUpload(*writer.finish())


def create_file(session: Session, *, owner: str, staged: StagedUpload, filename: str,
                purpose: str = "batch", created_at: datetime | None = None,
                expires_at: datetime | None = None, max_owner_bytes: int | None = None) -> File:
    """Register a staged upload: insert its row, charge its bytes, move it to `file-<id>.jsonl`.

    `expires_at`: when the purge deletes it (store.retention); None: kept until deleted.
    `max_owner_bytes`: QuotaExceeded (nothing kept) if the owner's stored bytes would pass it."""
    if purpose not in UPLOAD_PURPOSES:
        raise ValueError(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}")
    final_path: Path | None = None
    try:
        with write_transaction(session):
            charge_upload(session, owner=owner, size=staged.size, limit=max_owner_bytes)
            row = File(owner=owner, filename=filename[:512] or "upload.jsonl", purpose=purpose,
                       bytes=staged.size, lines=staged.lines, path="", created_at=created_at or utcnow(),
                       expires_at=expires_at)
            session.add(row)
            session.flush()
            final_path = staged.tmp_path.parent / f"file-{row.id}.jsonl"
            os.replace(staged.tmp_path, final_path)
            row.path = str(final_path)
    except BaseException:
        for leftover in (staged.tmp_path, final_path):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    leftover.unlink()
        raise
    return row


def get_file(session: Session, *, owner: str, file_id: int) -> File | None:
    """The owner's file, or None (absent, or another owner's)."""
    if not is_file_id(file_id):  # beyond the column's range (store.ids): absent, not a database error
        return None
    row = session.get(File, file_id)
    return row if row is not None and row.owner == owner else None


def list_files(session: Session, *, owner: str, purpose: str | None = None, limit: int = 100,
               after: int | None = None, order: str = "desc") -> tuple[list[File], bool]:
    """One page of the owner's files by id (`after` is a keyset cursor); returns (files, has_more)."""
    query = select(File).where(File.owner == owner)
    if purpose:
        query = query.where(File.purpose == purpose)
    if order == "asc":
        query = query.order_by(File.id.asc())
        if after is not None and after > MAX_FILE_ID:
            return [], False
        if after is not None:
            query = query.where(File.id > after)
    else:
        query = query.order_by(File.id.desc())
        if after is not None and after <= MAX_FILE_ID:  # a cursor past every id narrows nothing
            query = query.where(File.id < after)
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, *, owner: str, file_id: int) -> bool:
    """Delete the owner's file row and its bytes; False when there is no such file."""
    if not is_file_id(file_id):
        return False
    with write_transaction(session):
        row = session.get(File, file_id)
        if row is None or row.owner != owner:
            return False
        path = row.path
        session.delete(row)
        charge_storage(session, owner=owner, delta=-row.bytes)
    if path:
        with contextlib.suppress(OSError):
            Path(path).unlink()
    return True


def remove_stale_uploads(data_dir: str | Path, *, max_idle_s: float, now: float | None = None) -> list[Path]:
    """Delete staged uploads left by a killed process: their writer's pid is gone, or nothing was written
    to them for `max_idle_s` (a writer on another host sharing the directory). Returns what was removed."""
    directory, now = files_dir(data_dir), now if now is not None else time.time()
    removed: list[Path] = []
    for path in directory.glob(".upload-*.tmp") if directory.is_dir() else ():
        match = _STAGED.fullmatch(path.name)
        try:
            idle = now - path.stat().st_mtime
        except OSError:
            continue
        if match is None or not _alive(int(match.group(1))) or idle > max_idle_s:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True
