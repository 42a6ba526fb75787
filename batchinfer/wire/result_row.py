"""A worker's result row: what a ShardRunner hands the store for one request (issue 30).

workers/result_rows.py builds them, workers/result_cache.py annotates them (provenance, the body it stores
by reference), store/shards.write_results and store/results.apply_results record them. A success
(`SuccessRow`) carries the choices (or on /v1/embeddings the embeddings) and token counts; an error
(`ErrorRow`) OpenAI's {code, message}, its message naming the input line (ARCHITECTURE.md, contract 8).

TypedDicts, not msgspec Structs: a row is a plain dict at run time, so building one costs what a dict
costs (rows are written per request, thousands a second) and the store's JSON code (orjson.dumps of a
body, render_response) reads it as it is. `RowBody` is a success less the request's own fields
(request_id, provenance, result_body): what the result cache stores once per key and copies to every
request with that key. The rows are @final so that `"error" in row` tells the checker which one it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NotRequired, TypeAlias, TypedDict, final

# Where an output line's body came from (its provenance.result_cache).
ResultSource = Literal["miss", "hit", "dedup"]


class ErrorObject(TypedDict):
    """OpenAI's error of one line: a code and a message naming the line."""

    code: str
    message: str


@final
class ErrorRow(TypedDict):
    """A request that failed: its error instead of a body."""

    request_id: int
    error: ErrorObject


class TokenLogprob(TypedDict):
    """One token of OpenAI's chat logprobs: its text, logprob (None: the engine had none), UTF-8 bytes."""

    token: str
    logprob: float | None
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    """A generated token of a chat choice's logprobs, with its most likely alternatives."""

    top_logprobs: list[TokenLogprob]


class ChatLogprobs(TypedDict):
    """A chat choice's `logprobs` object."""

    content: list[ChatTokenLogprob]


class CompletionLogprobs(TypedDict):
    """A text completion choice's `logprobs` object: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


Logprobs: TypeAlias = ChatLogprobs | CompletionLogprobs


class Choice(TypedDict):
    """One completion of a request as the worker ran it (output_line.py renders it per endpoint)."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: Logprobs | None


class PromptTokenLogprob(TypedDict):
    """vLLM's prompt_logprobs entry of one candidate token."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt token null or {token id: its entry}
PromptLogprobs: TypeAlias = list[dict[str, PromptTokenLogprob] | None]


class EngineInfo(TypedDict):
    """The engine of a provenance: its name and version."""

    name: str
    version: str


class AdapterInfo(TypedDict):
    """The LoRA adapter of a provenance: its served name and the fingerprint of its files."""

    name: str
    fingerprint: str | None


class Provenance(TypedDict):
    """An output line's `provenance` object (workers/model_identity.ModelIdentity.provenance)."""

    engine: EngineInfo
    model: str
    model_fingerprint: str
    adapter: AdapterInfo | None
    dtype: str
    quantization: str | None
    seed: int | None
    result_cache: ResultSource
    computed_in: str  # "batch_<job id>"
    kv_cache_dtype: NotRequired[str]  # only when not "auto": rows written before it stay valid
    float32_matmul_precision: NotRequired[str]  # only when not "highest": bf16x3 on AMX ("auto", "high")


@dataclass(frozen=True)
class BodyRef:
    """A cacheable success's body as a worker offers it with its row: the key, the serialized body (a
    `RowBody`) and the job that computed it (store/result_cache.attach_bodies keeps it once per key)."""

    key: str
    body: bytes
    computed_in: int


class RowBody(TypedDict):
    """A success less the request's own fields: `choices` (completions, chat, responses) or `embeddings`
    (one per input: floats or base64), the token counts, and what else the body says."""

    choices: NotRequired[list[Choice]]
    embeddings: NotRequired[list[list[float] | str]]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_logprobs: NotRequired[PromptLogprobs]
    model: NotRequired[str]  # the served name (a line's body.model may route it to an adapter)


@final
class SuccessRow(RowBody):
    """A request that finished: its body, and what belongs to this request only."""

    request_id: int
    provenance: NotRequired[Provenance]  # absent from rows of older writers
    result_body: NotRequired[BodyRef | None]  # the body to store by reference (workers/result_cache.py)


ResultRow: TypeAlias = SuccessRow | ErrorRow
# Fields of a success that belong to one request, not to its body.
ROW_OWN_FIELDS = ("request_id", "provenance", "result_body")
