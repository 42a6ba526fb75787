"""Request bodies of the REST API (OpenAI's create-batch body plus our extensions) and the upload's /docs.

The objects the routes answer (Batch, File and their lists) are batchinfer.wire's, built by
batchinfer.store.serialize: one definition shared by the store, the API, the CLI and the dashboard.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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


class RetryBatchRequest(BaseModel):
    """Extension: POST /v1/batches/{id}/retry: which of a finished batch's lines to run again."""

    only: list[Literal["failed", "expired", "cancelled"]] | None = Field(None, max_length=3, description=(
        "Kinds of lines to retry; default all three."))
    include_invalid: bool = Field(False, description=(
        "Also retry lines whose input was invalid (left out and named by default: they cannot succeed)."))


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
