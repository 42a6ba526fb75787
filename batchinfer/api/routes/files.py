"""/v1/files: upload (streamed to disk under a size limit), list, retrieve, delete, download content.

Uploads are parsed from the raw request stream, so a file never sits in memory or in a temp spool:
its part is written straight to its final directory (in ~1 MiB writes, in a worker thread), and an
upload over the limit is refused as soon as it crosses it. Output and error files are generated from
the database on download (ids `file-out-<job>` / `file-err-<job>`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api import metrics
from batchinfer.api.deps import Caller, CallerDep, OwnerDep, SessionsDep, SettingsDep
from batchinfer.api.errors import ERROR_RESPONSES, APIError, ErrorResponse, bad_request, not_found
from batchinfer.config import Settings
from batchinfer.store import files as file_store
from batchinfer.store.jobs import export_results, get_job
from batchinfer.store.models import Job
from batchinfer.store.serialize import (
    error_file_id,
    file_object,
    output_file_id,
    parse_file_id,
    result_file_object,
)

router = APIRouter(prefix="/v1/files", tags=["files"])

WRITE_BYTES = 1 << 20  # file data is handed to the writer thread in pieces of about this size
EXPORT_CHUNK_BYTES = 64 * 1024
MAX_FIELD_BYTES = 4096
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # Content-Length slack over max_upload_bytes before refusing upfront

FileId = Annotated[str, Path(description="file-<n> (upload), file-out-<n> / file-err-<n> (batch results)",
                             examples=["file-1"])]


class FileObject(BaseModel):
    """OpenAI's File object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None


class FileList(BaseModel):
    """OpenAI's list of files."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class DeletedFile(BaseModel):
    """OpenAI's answer to a file deletion."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool


_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "examples": [{"file": '{"custom_id": "a", "prompt": "Hello"}\n', "purpose": "batch"}],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "A JSONL batch input file.",
                                 "examples": ['{"custom_id": "a", "prompt": "Hello"}\n']},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


class _StreamingForm:
    """A multipart/form-data body parsed as it arrives: small fields kept, the one file part streamed to disk."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.writer: file_store.UploadWriter | None = None
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._name = ""
        self._in_file = False
        self._value = bytearray()
        self._file_data = bytearray()

    def on_part_begin(self) -> None:
        self._disposition, self._name, self._in_file = b"", "", False
        self._value.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if bytes(self._header_name).lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" not in options:
            return
        if self._name != "file":
            raise bad_request(f"Unexpected file field '{self._name}': send the file as the 'file' field.",
                              param=self._name or None)
        if self.writer is not None:
            raise bad_request("Send exactly one file per upload.", param="file")
        _check_purpose(self.fields.get("purpose"), required=False)  # refuse before reading the file
        self.filename = options[b"filename"].decode("utf-8", "replace").replace("\\", "/").rsplit("/", 1)[-1]
        self.writer = file_store.UploadWriter(self.settings.data_dir, max_bytes=self.settings.max_upload_bytes,
                                              max_line_bytes=self.settings.max_line_bytes)
        self._in_file = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self._file_data += data[start:end]
            return
        if len(self._value) + end - start > MAX_FIELD_BYTES:
            raise bad_request(f"Form field '{self._name}' is longer than {MAX_FIELD_BYTES} bytes.",
                              param=self._name or None)
        self._value += data[start:end]

    def on_part_end(self) -> None:
        if not self._in_file and self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")
        self._in_file = False

    async def _flush(self, *, force: bool) -> None:
        if self.writer is not None and (len(self._file_data) >= WRITE_BYTES or (force and self._file_data)):
            data = bytes(self._file_data)
            self._file_data.clear()
            await anyio.to_thread.run_sync(self.writer.write, data)

    async def parse(self, request: Request) -> file_store.StagedUpload | None:
        """Consume the request body; returns the staged file (None when the body had no file part)."""
        _, params = parse_options_header(request.headers.get("content-type"))
        boundary = params.get(b"boundary")
        if not boundary:
            raise bad_request("Invalid multipart body: the Content-Type has no boundary.")
        parser = MultipartParser(boundary, {
            "on_part_begin": self.on_part_begin, "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end, "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
        })
        try:
            async for chunk in request.stream():
                parser.write(chunk)
                await self._flush(force=False)
            parser.finalize()
            await self._flush(force=True)
            if self.writer is None:
                return None
            return file_store.StagedUpload(*await anyio.to_thread.run_sync(self.writer.finish))
        except BaseException as exc:
            if self.writer is not None:
                self.writer.abort()
            if isinstance(exc, FormParserError):
                raise bad_request("Invalid multipart body; send multipart/form-data with 'file' and 'purpose'.") \
                    from None
            if isinstance(exc, file_store.FileTooLarge):
                raise APIError(413, f"File is too large: the limit is {exc.max_bytes} bytes.", param="file",
                               code="file_too_large") from None
            if isinstance(exc, file_store.InvalidFile):
                raise bad_request(f"Invalid file: {exc}.", param="file", code="invalid_file") from None
            raise


def _check_purpose(purpose: str | None, *, required: bool) -> None:
    if purpose is None:
        if required:
            raise bad_request("Missing required parameter: 'purpose' (use 'batch').", param="purpose")
        return
    if purpose not in file_store.UPLOAD_PURPOSES:
        raise bad_request(f"Invalid purpose '{purpose[:64]}': this server accepts only 'batch' uploads.",
                          param="purpose", code="invalid_value")


@router.post("", response_model=FileObject, openapi_extra=_UPLOAD_BODY,
             responses={**ERROR_RESPONSES, 413: {"model": ErrorResponse, "description": "File over the size limit"}},
             summary="Upload a JSONL batch input file")
async def upload_file(request: Request, owner: OwnerDep, settings: SettingsDep,
                      sessions: SessionsDep) -> dict[str, Any]:
    """Stream a multipart upload (fields `file`, `purpose=batch`) to storage; returns the File object."""
    content_type, _ = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data":
        raise bad_request("Content-Type must be multipart/form-data with the fields 'file' (a JSONL file) and "
                          "'purpose' ('batch').", param="file")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES:
        raise APIError(413, f"File is too large: the limit is {settings.max_upload_bytes} bytes.", param="file",
                       code="file_too_large")
    form = _StreamingForm(settings)
    staged = await form.parse(request)
    try:
        if staged is None:
            raise bad_request("Missing required parameter: 'file' (a JSONL file).", param="file")
        _check_purpose(form.fields.get("purpose"), required=True)
        row = await run_in_threadpool(_register, sessions, owner, staged, form.filename or "upload.jsonl")
    except BaseException:
        if staged is not None:
            staged.tmp_path.unlink(missing_ok=True)
        raise
    metrics.UPLOADED_BYTES.inc(staged.size)
    return file_object(row)


def _register(sessions: sessionmaker[Session], owner: str, staged: file_store.StagedUpload, filename: str) -> Any:
    with sessions() as session:
        return file_store.create_file(session, owner=owner, staged=staged, filename=filename)


# Read routes are async with one threadpool call each (see batches.py for why).


@router.get("", response_model=FileList, responses=ERROR_RESPONSES, summary="List your files")
async def list_files(
    caller: CallerDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """Your uploaded files, newest first (`after`: the last id of the previous page)."""
    return await run_in_threadpool(_list, caller, purpose, limit, after, order)


def _list(caller: Caller, purpose: str | None, limit: int, after: str | None, order: str) -> dict[str, Any]:
    with caller.session() as (session, owner):
        after_id = None
        if after:
            ref = parse_file_id(after)
            if ref is None or ref.kind != "input":
                raise bad_request(f"Invalid 'after' cursor '{after[:64]}': pass the id of a file from a previous "
                                  "page.", param="after")
            after_id = ref.id
        rows, has_more = file_store.list_files(session, owner=owner, purpose=purpose, limit=limit, after=after_id,
                                               order=order)
        data = [file_object(row) for row in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _result_job(session: Session, owner: str, file_id: str) -> tuple[Job, Literal["output", "error"]]:
    ref = parse_file_id(file_id)
    if ref is None or ref.kind == "input":
        raise not_found("File", file_id, param="file_id")
    job = get_job(session, job_id=ref.id, owner=owner)
    offered = job is not None and (output_file_id(job) if ref.kind == "output" else error_file_id(job)) == file_id
    if not offered:
        raise not_found("File", file_id, param="file_id")
    return job, ref.kind  # type: ignore[return-value]


@router.get("/{file_id}", response_model=FileObject, responses=ERROR_RESPONSES, summary="Retrieve a file")
async def retrieve_file(file_id: FileId, caller: CallerDep, request: Request) -> dict[str, Any]:
    """The File object of an upload, or of a batch's output/error file."""
    return await run_in_threadpool(_retrieve, caller, file_id, request.app.state.result_file_sizes)


def _retrieve(caller: Caller, file_id: str, sizes: dict[tuple[int, str], int]) -> dict[str, Any]:
    ref = parse_file_id(file_id)
    with caller.session() as (session, owner):
        if ref is not None and ref.kind == "input":
            row = file_store.get_file(session, owner=owner, file_id=ref.id)
            if row is None:
                raise not_found("File", file_id, param="file_id")
            return file_object(row)
        job, kind = _result_job(session, owner, file_id)
        size = sizes.get((job.id, kind))
        if size is None:  # results of a finished job no longer change: measure once
            lines = export_results(session, job_id=job.id, kind=_export_kind(kind))
            size = sizes[(job.id, kind)] = sum(map(len, lines))
        return result_file_object(job, kind, size=size)


def _export_kind(kind: str) -> Literal["output", "errors"]:
    return "output" if kind == "output" else "errors"


@router.delete("/{file_id}", response_model=DeletedFile, responses=ERROR_RESPONSES, summary="Delete a file")
async def delete_file(file_id: FileId, caller: CallerDep) -> dict[str, Any]:
    """Delete an uploaded file (batches made from it keep their requests)."""
    return await run_in_threadpool(_delete, caller, file_id)


def _delete(caller: Caller, file_id: str) -> dict[str, Any]:
    ref = parse_file_id(file_id)
    with caller.session() as (session, owner):
        if ref is not None and ref.kind != "input":
            _result_job(session, owner, file_id)  # 404 unless it is the caller's
            raise bad_request("Batch output and error files are generated from the batch and cannot be deleted.",
                              param="file_id")
        if ref is None or not file_store.delete_file(session, owner=owner, file_id=ref.id):
            raise not_found("File", file_id, param="file_id")
    return {"id": file_id, "object": "file", "deleted": True}


@router.get("/{file_id}/content", responses={200: {"content": {"application/jsonl": {}}}, **ERROR_RESPONSES},
            response_class=StreamingResponse, summary="Download a file's content")
def file_content(file_id: FileId, caller: CallerDep) -> StreamingResponse:
    """The bytes of an upload, or a batch's output/error lines generated from the database."""
    ref = parse_file_id(file_id)
    with caller.session() as (session, owner):
        if ref is not None and ref.kind == "input":
            row = file_store.get_file(session, owner=owner, file_id=ref.id)
            if row is None:
                raise not_found("File", file_id, param="file_id")
            return StreamingResponse(_read_file(row.path), media_type="application/jsonl")
        job, kind = _result_job(session, owner, file_id)
    return StreamingResponse(_export(caller.sessions, job.id, kind), media_type="application/jsonl")


def _read_file(path: str) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(EXPORT_CHUNK_BYTES):
            yield chunk


def _export(sessions: sessionmaker[Session], job_id: int, kind: str) -> Iterator[bytes]:
    """Export lines joined into ~64 KiB chunks (one thread hop per chunk, not per line)."""
    lines_counter = metrics.EXPORTED_LINES.labels(kind)
    bytes_counter = metrics.EXPORTED_BYTES.labels(kind)
    with sessions() as session:
        buffer: list[bytes] = []
        size = 0
        for line in export_results(session, job_id=job_id, kind=_export_kind(kind)):
            buffer.append(line)
            size += len(line)
            if size >= EXPORT_CHUNK_BYTES:
                lines_counter.inc(len(buffer))
                bytes_counter.inc(size)
                yield b"".join(buffer)
                buffer, size = [], 0
        if buffer:
            lines_counter.inc(len(buffer))
            bytes_counter.inc(size)
            yield b"".join(buffer)
