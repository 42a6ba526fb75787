"""Multipart uploads, parsed from the raw request stream (POST /v1/files).

A file never sits in memory or in a temp spool: its part is written straight to its final directory
(in ~1 MiB writes, in a worker thread), and an upload over the limit is refused as soon as it crosses
it (or before reading, when Content-Length already says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from batchinfer.api.errors import APIError, bad_request
from batchinfer.config import Settings
from batchinfer.store import files as file_store

WRITE_BYTES = 1 << 20  # file data is handed to the writer thread in pieces of about this size
MAX_FIELD_BYTES = 4096
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # Content-Length slack over max_upload_bytes before refusing upfront
DEFAULT_FILENAME = "upload.jsonl"


@dataclass(frozen=True, slots=True)
class Upload:
    """A received upload: the staged file (not registered yet), its client-side name and its purpose."""

    staged: file_store.StagedUpload
    filename: str
    purpose: str
    fields: dict[str, str] = field(default_factory=dict)  # every small form field (the web form sends more)


async def receive_upload(request: Request, settings: Settings, *, quota_left: int | None = None) -> Upload:
    """Check the headers, stream the body to a staged file; 400 / 413 (OpenAI shape) when it is unusable.

    `quota_left`: the owner's storage left; the file stops (store.quotas.QuotaExceeded) once past it."""
    content_type, _ = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data":
        raise bad_request("Content-Type must be multipart/form-data with the fields 'file' (a JSONL file) "
                          "and 'purpose' ('batch').", param="file")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES:
        raise _too_large(settings.max_upload_bytes)
    form = StreamingForm(settings, quota_left=quota_left)
    staged = await form.parse(request)
    if staged is None:
        raise bad_request("Missing required parameter: 'file' (a JSONL file).", param="file")
    try:
        check_purpose(form.fields.get("purpose"), required=True)
    except BaseException:
        staged.tmp_path.unlink(missing_ok=True)
        raise
    return Upload(staged, form.filename or DEFAULT_FILENAME, form.fields["purpose"], dict(form.fields))


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"File is too large: the limit is {max_bytes} bytes.", param="file",
                    code="file_too_large")


class StreamingForm:
    """A multipart/form-data body parsed as it arrives: small fields kept, the file part streamed to disk.

    The on_* methods are python-multipart's parser callbacks.
    """

    def __init__(self, settings: Settings, *, quota_left: int | None = None) -> None:
        self.settings = settings
        self.quota_left = quota_left
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
        self.complete = False  # the closing boundary (--boundary--) was seen: the body was not cut off
        self._parts = 0

    def on_part_begin(self) -> None:
        self._disposition, self._name, self._in_file = b"", "", False
        self._value.clear()
        self._parts += 1
        if self._parts > self.settings.max_form_fields:  # every part held in memory is a field but one
            raise APIError(413, f"Too many form fields: the limit is {self.settings.max_form_fields} "
                           "(max_form_fields); send 'file' and 'purpose'.", code="too_many_fields")

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]
        self._check_header()

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        self._check_header()

    def _check_header(self) -> None:
        if len(self._header_name) + len(self._header_value) > MAX_FIELD_BYTES:
            raise bad_request(f"Invalid multipart body: a part header is over {MAX_FIELD_BYTES} bytes.")

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
        check_purpose(self.fields.get("purpose"), required=False)  # refuse before reading the file
        self.filename = options[b"filename"].decode("utf-8", "replace").replace("\\", "/").rsplit("/", 1)[-1]
        if "\x00" in self.filename:  # PostgreSQL text cannot hold it; refuse before reading the file
            raise bad_request("Invalid filename: it contains the NUL character (\\u0000); rename the file.",
                              param="file", code="invalid_value")
        self.writer = file_store.UploadWriter(self.settings.data_dir,
                                              max_bytes=self.settings.max_upload_bytes,
                                              max_line_bytes=self.settings.max_line_bytes,
                                              quota_left=self.quota_left,
                                              quota=self.settings.max_owner_stored_bytes)
        self._in_file = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self._file_data += data[start:end]
            return
        if len(self._value) + end - start > MAX_FIELD_BYTES:
            raise bad_request(f"Form field '{self._name}' is longer than {MAX_FIELD_BYTES} bytes.",
                              param=self._name or None)
        self._value += data[start:end]

    def on_end(self) -> None:
        self.complete = True

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
            "on_headers_finished": self.on_headers_finished, "on_end": self.on_end,
        })
        try:
            received, limit = 0, self.settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:  # the whole body, chunked or not, fields included
                    raise _too_large(self.settings.max_upload_bytes)
                parser.write(chunk)
                await self._flush(force=False)
            parser.finalize()
            if not self.complete:  # python-multipart's finalize() accepts a body cut off mid-part
                raise bad_request("Invalid multipart body: it ended before its closing boundary (the "
                                  "upload was cut off); nothing was stored, send the whole file again.",
                                  param="file")
            await self._flush(force=True)
            if self.writer is None:
                return None
            return file_store.StagedUpload(*await anyio.to_thread.run_sync(self.writer.finish))
        except BaseException as exc:
            if self.writer is not None:
                self.writer.abort()
            if isinstance(exc, FormParserError):
                raise bad_request("Invalid multipart body; send multipart/form-data with 'file' and "
                                  "'purpose'.") from None
            if isinstance(exc, file_store.FileTooLarge):
                raise _too_large(exc.max_bytes) from None
            if isinstance(exc, file_store.InvalidFile):
                raise bad_request(f"Invalid file: {exc}.", param="file", code="invalid_file") from None
            raise


def check_purpose(purpose: str | None, *, required: bool) -> None:
    """400 unless `purpose` is one we accept (or absent, when not `required`)."""
    if purpose is None:
        if required:
            raise bad_request("Missing required parameter: 'purpose' (use 'batch').", param="purpose")
        return
    if purpose not in file_store.UPLOAD_PURPOSES:
        raise bad_request(f"Invalid purpose '{purpose[:64]}': this server accepts only 'batch' uploads.",
                          param="purpose", code="invalid_value")
