"""Request and response bodies of the REST API: OpenAI's Batch and File objects, plus our extensions.

The routes return plain dicts built by batchinfer.store.serialize; these models are what FastAPI
validates them against and what /docs and schema-driven clients see.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batchinfer.store.estimate import Estimate


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy: `seconds` (one hour to 30 days) after the anchor."""

    anchor: Literal["created_at"] = Field(description="Only 'created_at': the file's creation (a batch's "
                                          "output file is created when the batch ends).")
    seconds: int = Field(ge=3600, le=30 * 86400)


class CreateBatchRequest(BaseModel):
    """OpenAI's create-batch body, plus `model` (the model to run; default: the server's default model)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), json_schema_extra={"examples": [
        {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}]})

    input_file_id: str = Field(max_length=64, examples=["file-1"])
    endpoint: str | None = Field(max_length=64, examples=["/v1/chat/completions"], description=(
        "/v1/chat/completions or /v1/completions: every line must use it. Extension: omitted or null, each "
        "line may use either (what `batchinfer submit --server` sends for a mixed file)."))
    completion_window: str = Field("24h", max_length=16,
                                   description="OpenAI accepts only '24h'; also <n>s|m|h|d")
    metadata: dict[str, str] | None = Field(None, examples=[{"team": "nlp"}])
    model: str | None = Field(None, max_length=256, description="Extension: the model to run this batch on.")
    on_invalid: Literal["skip", "fail"] | None = Field(None, description=(
        "Extension: 'fail' is OpenAI's all-or-nothing validation (one bad line fails the batch, its "
        "`errors` list the lines); 'skip' (the default) errors bad lines alone and runs the rest."))
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1, description=(
        "Extension: lower runs first (vLLM's convention); default 0."))
    shard_size: int | None = Field(None, ge=1, le=1_000_000, description=(
        "Extension: requests per shard; default the server's shard_size setting."))
    output_expires_after: ExpiresAfter | None = Field(None, description=(
        "When the output and error files expire: the batch and its results are purged then."))
    result_cache: Literal["use", "refresh", "off"] | None = Field(None, description=(
        "Extension: 'use' serves deterministic lines (temperature 0 or a seed) computed before for this "
        "owner from the result cache, 'refresh' computes them again and replaces, 'off' neither; default "
        "the server's result_cache setting (the openai client sends it through extra_body)."))
    max_total_tokens: int | None = Field(None, ge=1, le=2**62, description=(
        "Extension: the batch's token budget (prompt + completion tokens of all its lines); lines past it "
        "end with a `budget_exceeded` error, finished lines are kept. Default: none."))


class BatchErrorItem(BaseModel):
    """One entry of a batch's errors: a line-numbered problem of its input file."""

    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    """OpenAI's list of a batch's errors."""

    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class RequestCounts(BaseModel):
    """How many of the batch's requests there are, succeeded and failed."""

    total: int
    completed: int
    failed: int


class BatchProgress(BaseModel):
    """Extension: how far the batch is (OpenAI clients ignore it)."""

    fraction: float
    tokens_per_second: float | None = Field(None, description="Generated tokens per second since the "
                                                              "first shard was claimed (an average), "
                                                              "counting requests still in flight.")
    requests_per_second: float | None = Field(None, description="Requests finished by workers per second "
                                                                "since the first shard was claimed.")
    eta_seconds: float | None = Field(None, description="Seconds left: remaining_tokens at "
                                                        "tokens_per_second; null until tokens were "
                                                        "generated.")
    generated_tokens: int | None = Field(None, description="Tokens generated so far: finished requests' and "
                                                           "in-flight ones' (the workers' last heartbeats).")
    remaining_tokens: int | None = Field(None, description="Tokens expected still to come: the requests' "
                                                           "max_tokens budgets left, scaled by the share "
                                                           "finished requests used.")
    input_tokens_per_second: float | None = Field(None, description="Input tokens read per second since the "
                                                                    "first claim (an embeddings batch's "
                                                                    "throughput).")
    started_at: int | None = Field(None, description="When a worker first claimed one of its shards.")
    at_risk: bool = Field(False, description="The batch runs and its predicted finish (now + eta_seconds) "
                                             "falls after its deadline, expires_at.")
    note: str | None = Field(None, description="Why the batch does not move, e.g. no live worker serves "
                                               "its model.")


class ResultCacheCounts(BaseModel):
    """Extension: the batch's result_cache mode and its successes served from the cache."""

    mode: str
    hits: int = Field(description="Lines served from an earlier batch's result.")
    dedups: int = Field(description="Lines copied from an identical line of this batch.")


class RetryBatchRequest(BaseModel):
    """Extension: POST /v1/batches/{id}/retry: which of a finished batch's lines to run again."""

    only: list[Literal["failed", "expired", "cancelled"]] | None = Field(None, max_length=3, description=(
        "Kinds of lines to retry; default all three."))
    include_invalid: bool = Field(False, description=(
        "Also retry lines whose input was invalid (left out and named by default: they cannot succeed)."))


class RetryLeftOut(BaseModel):
    """A line a retry left out: its input was invalid."""

    line: int
    code: str | None = None


class RetryInfo(BaseModel):
    """Extension, in the answer of a retry: the parent batch, the lines retried, those left out."""

    of: str
    lines: int
    left_out: list[RetryLeftOut]


class BatchObject(BaseModel):
    """OpenAI's Batch object (+ `model` and the `progress` extension)."""

    model_config = ConfigDict(protected_namespaces=())

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str | None  # null: a batch whose lines may use either endpoint (extension)
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str | None
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    usage: dict[str, Any]
    max_total_tokens: int | None = Field(None, description=(
        "Extension: the batch's token budget, when it has one; usage never exceeds it."))
    estimate: Estimate | None = Field(None, description=(
        "Extension: the estimate made at submit from ingest's counts (prompt tokens not counted), the "
        "figures of POST /v1/batches/estimate; `progress.eta_seconds` refines it while the batch runs."))
    progress: BatchProgress
    result_cache: ResultCacheCounts | None = None
    retry: RetryInfo | None = None  # only in the answer of POST /v1/batches/{id}/retry


class BatchList(BaseModel):
    """OpenAI's list of batches, newest first."""

    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


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


# The multipart body of POST /v1/files, for /docs (the route parses the raw stream itself: see uploads.py).
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "examples": [{"file": '{"custom_id": "a", "prompt": "Hello"}\n', "purpose": "batch"}],
                    "properties": {
                        "file": {"type": "string", "format": "binary",
                                 "description": "A JSONL batch input file.",
                                 "examples": ['{"custom_id": "a", "prompt": "Hello"}\n']},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}
