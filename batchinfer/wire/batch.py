"""OpenAI's Batch object and its parts, plus batchinfer's extensions: the one definition the store builds
(store.serialize), the API answers, the CLI reads (from the database or a server) and the dashboard shows.

Its `status` is the store's JobStatus (store/statuses.py), the one status enum. Extensions OpenAI clients
ignore: `model`, `progress`, `estimate`, `max_total_tokens`, `result_cache`, `retry` (only in a retry's
answer) and, in the operator's view only (the local CLI), `owner` (OperatorBatch).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from batchinfer.store.statuses import JobStatus


class BatchErrorItem(BaseModel):
    """One line error of a batch's input file, as ingest records it: the line and the field as data."""

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


class InputTokensDetails(BaseModel):
    """Of the input tokens, those the prefix cache served."""

    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """Of the output tokens, reasoning ones (none here)."""

    reasoning_tokens: int = 0


class Usage(BaseModel):
    """The batch's token usage so far."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class BatchProgress(BaseModel):
    """Extension: how far the batch is (OpenAI clients ignore it)."""

    fraction: float = 0.0
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

    mode: str = "use"
    hits: int = Field(0, description="Lines served from an earlier batch's result.")
    dedups: int = Field(0, description="Lines copied from an identical line of this batch.")


class RetryLeftOut(BaseModel):
    """A line a retry left out: its input was invalid."""

    line: int
    code: str | None = None


class RetryInfo(BaseModel):
    """Extension, in the answer of a retry: the parent batch, the lines retried, those left out."""

    of: str
    lines: int
    left_out: list[RetryLeftOut]


class Estimate(BaseModel):
    """What a file will cost on this deployment (README "Sharing the workers"): `batchinfer estimate`'s
    figures, POST /v1/batches/estimate's object, and a batch's `estimate` made at submit (from_counts)."""

    model_config = ConfigDict(protected_namespaces=())

    model: str
    requests: int
    invalid_lines: int
    prompt_tokens: int | None  # None at submit: ingest does not tokenize
    cached_prompt_tokens: int | None
    max_output_tokens: int
    expected_output_tokens: int
    expected_seconds: float | None
    live_workers: int
    basis: list[str]
    result_cache_hits: int | None = None  # None: unknown (no recorded identity), not read, or at submit
    errors: list[BatchErrorItem] = []

    def as_dict(self) -> dict[str, object]:
        """The JSON object of `estimate --json` (and of the job's stored estimate)."""
        return self.model_dump()


class BatchObject(BaseModel):
    """OpenAI's Batch object (+ `model` and the extensions of the module docstring)."""

    model_config = ConfigDict(protected_namespaces=())

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str | None  # null: a batch whose lines may use either endpoint (extension)
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str | None
    completion_window: str
    status: JobStatus
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
    usage: Usage = Field(default_factory=Usage)
    max_total_tokens: int | None = Field(None, description=(
        "Extension: the batch's token budget, when it has one; usage never exceeds it."))
    estimate: Estimate | None = Field(None, description=(
        "Extension: the estimate made at submit from ingest's counts (prompt tokens not counted), the "
        "figures of POST /v1/batches/estimate; `progress.eta_seconds` refines it while the batch runs."))
    progress: BatchProgress = Field(default_factory=BatchProgress)  # a plain OpenAI server sends none
    result_cache: ResultCacheCounts | None = None
    retry: RetryInfo | None = None  # only in the answer of POST /v1/batches/{id}/retry

    @property
    def line_errors(self) -> list[BatchErrorItem]:
        """The input file's line errors listed on the batch (none: an empty list)."""
        return self.errors.data if self.errors is not None else []


class OperatorBatch(BatchObject):
    """The operator's view of a batch (the local CLI acts on any owner's): the Batch object and its owner."""

    owner: str


class BatchList(BaseModel):
    """OpenAI's list of batches, newest first."""

    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
