"""/v1/files: upload (streamed to disk under a size limit), list, retrieve, delete, download content.

Uploads are parsed from the raw request stream (see uploads.py), so a file never sits in memory.
Output and error files are generated from the database on download (ids `file-out-<job>` /
`file-err-<job>`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api import metrics
from batchinfer.api.deps import Caller, CallerDep, OwnerDep, SessionsDep, SettingsDep
from batchinfer.api.errors import ERROR_RESPONSES, ErrorResponse, bad_request, not_found
from batchinfer.api.schemas import UPLOAD_BODY, DeletedFile, FileList, FileObject
from batchinfer.api.uploads import Upload, receive_upload
from batchinfer.store import files as file_store
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job
from batchinfer.store.models import Job
from batchinfer.store.serialize import (
    error_file_id,
    file_object,
    output_file_id,
    parse_file_id,
    result_file_object,
)

router = APIRouter(prefix="/v1/files", tags=["files"])

EXPORT_CHUNK_BYTES = 64 * 1024

FileId = Annotated[str, Path(description="file-<n> (upload), file-out-<n> / file-err-<n> (batch results)",
                             examples=["file-1"])]


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_BODY,
             responses={**ERROR_RESPONSES,
                        413: {"model": ErrorResponse, "description": "File over the size limit"}},
             summary="Upload a JSONL batch input file")
async def upload_file(request: Request, owner: OwnerDep, settings: SettingsDep,
                      sessions: SessionsDep) -> dict[str, Any]:
    """Stream a multipart upload (fields `file`, `purpose=batch`) to storage; returns the File object."""
    upload = await receive_upload(request, settings)
    try:
        row = await run_in_threadpool(_register, sessions, owner, upload)
    except BaseException:
        upload.staged.tmp_path.unlink(missing_ok=True)
        raise
    metrics.UPLOADED_BYTES.inc(upload.staged.size)
    return file_object(row)


def _register(sessions: sessionmaker[Session], owner: str, upload: Upload) -> Any:
    with sessions() as session:
        return file_store.create_file(session, owner=owner, staged=upload.staged, filename=upload.filename,
                                      purpose=upload.purpose)


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
                raise bad_request(f"Invalid 'after' cursor '{after[:64]}': pass the id of a file from a "
                                  "previous page.", param="after")
            after_id = ref.id
        rows, has_more = file_store.list_files(session, owner=owner, purpose=purpose, limit=limit,
                                               after=after_id, order=order)
        data = [file_object(row) for row in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _result_job(session: Session, owner: str, file_id: str) -> tuple[Job, Literal["output", "error"]]:
    ref = parse_file_id(file_id)
    if ref is None or ref.kind == "input":
        raise not_found("File", file_id, param="file_id")
    job = get_job(session, job_id=ref.id, owner=owner)
    offered_id = (output_file_id(job) if ref.kind == "output" else error_file_id(job)) if job else None
    offered = offered_id == file_id
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
            raise bad_request("Batch output and error files are generated from the batch and cannot be "
                              "deleted.", param="file_id")
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
