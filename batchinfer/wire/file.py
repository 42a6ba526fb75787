"""OpenAI's File object, its list and its deletion answer: the one definition the store builds
(store.serialize), the API answers and the CLI reads back from a server."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FilePurpose = Literal["batch", "batch_output"]
"""What a file is for: an uploaded batch input, or a batch's generated output / error file."""


class FileObject(BaseModel):
    """OpenAI's File object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = Field(
        "processed", description="Deprecated by OpenAI; always 'processed' here (a stored file is complete).")
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
