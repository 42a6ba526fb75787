"""/v1/files: upload (streamed to disk under a size limit), list, retrieve, delete, download content.

Uploads are parsed from the raw request stream (see uploads.py), so a file never sits in memory; an
owner over its storage quota, or already streaming max_owner_concurrent_uploads files, is answered 429
before any byte lands. Output and error files are generated from the database on download (ids
`file-out-<job>` / `file-err-<job>`, purpose `batch_output`): they are listed after the uploads with
the sizes stored when their job ended, and deleting one deletes the result rows it is made of
(store.result_files).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.api import metrics
from batchinfer.api.deps import Caller, CallerDep, OwnerDep, SessionsDep, SettingsDep
from batchinfer.api.errors import ERROR_RESPONSES, ErrorResponse, bad_request, not_found
from batchinfer.api.limits import quota_errors, upload_expires_at, upload_slot
from batchinfer.api.schemas import UPLOAD_BODY
from batchinfer.api.uploads import MULTIPART_OVERHEAD_BYTES, Upload, receive_upload
from batchinfer.config import Settings
from batchinfer.store import files as file_store
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job
from batchinfer.store.models import File, Job, utcnow
from batchinfer.store.quotas import check_storage_quota, stored_bytes
from batchinfer.store.result_files import (
    delete_result_file,
    list_result_files,
    result_file_exists,
    result_file_size,
)
from batchinfer.store.serialize import (
    error_file_id,
    file_object,
    output_file_id,
    parse_file_id,
    result_file_object,
)
from batchinfer.wire.file import DeletedFile, FileList, FileObject

router = APIRouter(prefix="/v1/files", tags=["files"])

EXPORT_CHUNK_BYTES = 64 * 1024

FileId = Annotated[str, Path(description="file-<n> (upload), file-out-<n> / file-err-<n> (batch results)",
                             examples=["file-1"])]


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_BODY,
             responses={**ERROR_RESPONSES,
                        413: {"model": ErrorResponse, "description": "File over the size limit"}},
             summary="Upload a JSONL batch input file")
async def upload_file(request: Request, owner: OwnerDep, settings: SettingsDep,
                      sessions: SessionsDep) -> FileObject:
    """Stream a multipart upload (fields `file`, `purpose=batch`) to storage; returns the File object."""
    async with upload_slot(request.app, owner, settings):
        upload = await receive_owner_upload(request, owner, settings, sessions)
        return file_object(await store_upload(sessions, owner, upload, settings))


async def receive_owner_upload(request: Request, owner: str, settings: Settings,
                               sessions: sessionmaker[Session]) -> Upload:
    """receive_upload within the owner's storage quota: 429 before reading when it is used up (or the
    Content-Length says the upload would pass it), and as soon as the bytes streamed pass what is left."""
    limit = settings.max_owner_stored_bytes
    if limit is None:
        return await receive_upload(request, settings)
    length = request.headers.get("content-length")
    announced = int(length) - MULTIPART_OVERHEAD_BYTES if length and length.isdigit() else 0

    def left() -> int:
        with sessions() as session, quota_errors():
            check_storage_quota(session, owner=owner, settings=settings, new_bytes=max(announced, 1))
            return limit - stored_bytes(session, owner=owner)

    quota_left = await run_in_threadpool(left)
    with quota_errors():
        return await receive_upload(request, settings, quota_left=quota_left)


async def store_upload(sessions: sessionmaker[Session], owner: str, upload: Upload,
                       settings: Settings) -> File:
    """Register a received upload as the owner's file (its staged bytes are removed if that fails)."""
    try:
        row = await run_in_threadpool(register_upload, sessions, owner, upload, settings)
    except BaseException:
        upload.staged.tmp_path.unlink(missing_ok=True)
        raise
    metrics.UPLOADED_BYTES.inc(upload.staged.size)
    return row


def register_upload(sessions: sessionmaker[Session], owner: str, upload: Upload, settings: Settings) -> File:
    """Record a received upload as the owner's File (storage quota, checked and charged atomically with its
    row; expires_after); /ui uploads use it too."""
    now = utcnow()
    expires_at = upload_expires_at(upload.fields, now)  # OpenAI's expires_after form fields, or None
    with sessions() as session, quota_errors():
        return file_store.create_file(session, owner=owner, staged=upload.staged, filename=upload.filename,
                                      purpose=upload.purpose, created_at=now, expires_at=expires_at,
                                      max_owner_bytes=settings.max_owner_stored_bytes)


# Read routes are async with one threadpool call each (see batches.py for why).


@router.get("", response_model=FileList, responses=ERROR_RESPONSES, summary="List your files")
async def list_files(
    caller: CallerDep,
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    """Your files: uploads (purpose `batch`), then your batches' output and error files (purpose
    `batch_output`), each newest first unless `order=asc`; `purpose` keeps one of the two, and `after`
    is the last id of the previous page."""
    return await run_in_threadpool(_list, caller, purpose, limit, after, order)


def _list(caller: Caller, purpose: str | None, limit: int, after: str | None, order: str) -> FileList:
    ref = parse_file_id(after) if after else None
    wrong_kind = ref is not None and (ref.kind == "input" if purpose == "batch_output"
                                      else ref.kind != "input" and purpose is not None)
    if after and (ref is None or wrong_kind):
        raise bad_request(f"Invalid 'after' cursor '{after[:64]}': pass the id of a file from a "
                          "previous page.", param="after")
    data: list[FileObject] = []
    has_more = False
    with caller.session() as (session, owner):
        if purpose != "batch_output" and (ref is None or ref.kind == "input"):
            rows, has_more = file_store.list_files(session, owner=owner, purpose=purpose, limit=limit,
                                                   after=ref.id if ref else None, order=order)
            data = [file_object(row) for row in rows]
        if purpose in (None, "batch_output") and not has_more and len(data) < limit:
            result_after = (ref.id, ref.kind) if ref is not None and ref.kind != "input" else None
            files, has_more = list_result_files(session, owner=owner, limit=limit - len(data),
                                                after=result_after, order=order)
            data += [result_file_object(f.job, f.kind, size=result_file_size(session, job=f.job, kind=f.kind))
                     for f in files]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=has_more)


def _result_job(session: Session, owner: str, file_id: str) -> tuple[Job, Literal["output", "error"]]:
    ref = parse_file_id(file_id)
    if ref is None or ref.kind == "input":
        raise not_found("File", file_id, param="file_id")
    job = get_job(session, job_id=ref.id, owner=owner)
    offered_id = (output_file_id(job) if ref.kind == "output" else error_file_id(job)) if job else None
    offered = offered_id == file_id and result_file_exists(session, job=job, kind=ref.kind)  # type: ignore[arg-type]
    if not offered:
        raise not_found("File", file_id, param="file_id")
    return job, ref.kind  # type: ignore[return-value]


@router.get("/{file_id}", response_model=FileObject, responses=ERROR_RESPONSES, summary="Retrieve a file")
async def retrieve_file(file_id: FileId, caller: CallerDep, request: Request) -> FileObject:
    """The File object of an upload, or of a batch's output/error file."""
    return await run_in_threadpool(_retrieve, caller, file_id)


def _retrieve(caller: Caller, file_id: str) -> FileObject:
    ref = parse_file_id(file_id)
    with caller.session() as (session, owner):
        if ref is not None and ref.kind == "input":
            row = file_store.get_file(session, owner=owner, file_id=ref.id)
            if row is None:
                raise not_found("File", file_id, param="file_id")
            return file_object(row)
        job, kind = _result_job(session, owner, file_id)
        return result_file_object(job, kind, size=result_file_size(session, job=job, kind=kind))


def _export_kind(kind: str) -> Literal["output", "errors"]:
    return "output" if kind == "output" else "errors"


@router.delete("/{file_id}", response_model=DeletedFile, responses=ERROR_RESPONSES, summary="Delete a file")
async def delete_file(file_id: FileId, caller: CallerDep, request: Request) -> DeletedFile:
    """Delete an uploaded file (batches made from it keep their requests), or a batch's output or error
    file (its result lines are deleted; the batch keeps its request_counts)."""
    return await run_in_threadpool(_delete, caller, file_id)


def _delete(caller: Caller, file_id: str) -> DeletedFile:
    ref = parse_file_id(file_id)
    with caller.session() as (session, owner):
        if ref is not None and ref.kind != "input":
            job, kind = _result_job(session, owner, file_id)  # 404 unless it is the caller's
            if not delete_result_file(session, owner=owner, job_id=job.id, kind=kind):
                raise not_found("File", file_id, param="file_id")
            return DeletedFile(id=file_id, deleted=True)
        if ref is None or not file_store.delete_file(session, owner=owner, file_id=ref.id):
            raise not_found("File", file_id, param="file_id")
    return DeletedFile(id=file_id, deleted=True)


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
