"""Output and error lines of a batch (OpenAI Batch API): the models export encodes, and their schema.

`response_body` turns a worker's choices into a chat.completion / text_completion / response object, which the
requests table stores; `output_line` and `error_line` wrap it (or an error) into an `OutputLine`, a line of
the output or error file, which `encode_line` writes. The stored body and provenance are spliced in as
they are stored (msgspec.Raw: never parsed again). `read_output_line` reads a line back against the
schema below (`BatchOutputLine`: each body's shape), for readers and the tests that check export's lines.
msgspec, not pydantic: chosen by measurement (bench/wire_models.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import orjson

from batchinfer.wire.embeddings import embedding_list
from batchinfer.wire.json_types import JSONObject
from batchinfer.wire.request import Endpoint
from batchinfer.wire.responses import response_object
from batchinfer.wire.result_row import Choice, PromptLogprobs


def response_body(*, endpoint: str, model: str, request_key: int, created: int, choices: Sequence[Choice],
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                  embeddings: list[list[float] | str] | None = None,
                  prompt_logprobs: PromptLogprobs | None = None) -> dict[str, object]:
    """A chat.completion / text_completion / response from a worker's choices, or an embedding list.

    prompt_logprobs (vLLM's field, when the line asked for it) goes where vLLM puts it: on the chat
    completion, and on each choice of a text completion.
    """
    if endpoint == Endpoint.EMBEDDINGS:
        return embedding_list(model=model, embeddings=embeddings or [], prompt_tokens=prompt_tokens)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if endpoint == Endpoint.RESPONSES:  # no n on /v1/responses: one choice
        return response_object(request_key=request_key, created=created, model=model, choice=choices[0],
                               prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                               cached_tokens=cached_tokens)
    if endpoint == Endpoint.CHAT:
        out_choices = [{"index": c.get("index", i), "message": {"role": "assistant", "content": c["text"]},
                        "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]}
                       for i, c in enumerate(choices)]
        body = {"id": f"chatcmpl-batch-{request_key}", "object": "chat.completion", "created": created,
                "model": model, "choices": out_choices, "usage": usage}
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        return body
    text_choices: list[dict[str, object]] = [
        {"index": c.get("index", i), "text": c["text"], "logprobs": c.get("logprobs"),
         "finish_reason": c["finish_reason"]} for i, c in enumerate(choices)]
    if prompt_logprobs is not None:
        for choice in text_choices:
            choice["prompt_logprobs"] = prompt_logprobs
    return {"id": f"cmpl-batch-{request_key}", "object": "text_completion", "created": created,
            "model": model, "choices": text_choices, "usage": usage}


class BatchResponse(msgspec.Struct):
    """A success line's response: its status, OpenAI's request id, the body as stored (spliced as is)."""

    status_code: int
    request_id: str
    body: msgspec.Raw


class BatchError(msgspec.Struct):
    """An error line's error: machine-readable code, and the message naming the input line."""

    code: str
    message: str | None


class OutputLine(msgspec.Struct, omit_defaults=True):
    """A line of the output file (response set, error null) or of the error file (response null).

    `provenance` (batchinfer's: engine, model fingerprint, result cache; store/result_cache.py) is left
    out when the row has none."""

    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchError | None
    provenance: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


def _raw(value: JSONObject | str | bytes) -> msgspec.Raw:
    return msgspec.Raw(value if isinstance(value, str | bytes) else orjson.dumps(value))


def output_line(*, request_key: int, custom_id: str, body: JSONObject | str | bytes,
                provenance: str | bytes | None = None) -> OutputLine:
    """A success line of the output file; `body` and `provenance` may be the JSON text as stored."""
    return OutputLine(f"batch_req_{request_key}", custom_id,
                      BatchResponse(200, f"req_{request_key}", _raw(body)), None,
                      msgspec.UNSET if provenance is None else msgspec.Raw(provenance))


def error_line(*, request_key: int, custom_id: str, code: str, message: str | None) -> OutputLine:
    """A line of the error file: same shape as a success line, response null."""
    return OutputLine(f"batch_req_{request_key}", custom_id, None, BatchError(code, message))


_ENCODER = msgspec.json.Encoder()


def encode_line(line: OutputLine) -> bytes:
    """The line as the file holds it: its JSON and a newline."""
    buffer = bytearray()
    _ENCODER.encode_into(line, buffer)
    buffer += b"\n"
    return bytes(buffer)


# ------------------------------------------------------------------------------- schema of a line


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(msgspec.Struct, tag_field="object", tag="chat.completion"):
    """A /v1/chat/completions line's body."""

    id: str
    created: int
    model: str
    choices: list[JSONObject]
    usage: Usage
    prompt_logprobs: list[JSONObject | None] | None = None  # lines that asked (vLLM)


class TextCompletion(msgspec.Struct, tag_field="object", tag="text_completion"):
    """A /v1/completions line's body."""

    id: str
    created: int
    model: str
    choices: list[JSONObject]
    usage: Usage


class ResponseObject(msgspec.Struct, tag_field="object", tag="response"):
    """A /v1/responses line's body (responses.response_object)."""

    id: str
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[JSONObject]
    usage: JSONObject
    incomplete_details: JSONObject | None = None


class EmbeddingList(msgspec.Struct, tag_field="object", tag="list"):
    """A /v1/embeddings line's body (embeddings.embedding_list)."""

    data: list[JSONObject]
    model: str
    usage: dict[str, int]


class ParsedResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: ChatCompletion | TextCompletion | ResponseObject | EmbeddingList


class BatchOutputLine(msgspec.Struct):
    """A line of the output or error file as a reader sees it: each body checked against its shape."""

    id: str
    custom_id: str
    response: ParsedResponse | None
    error: BatchError | None
    provenance: JSONObject | None = None


_READER = msgspec.json.Decoder(BatchOutputLine)


def read_output_line(line: bytes | str | JSONObject | OutputLine) -> BatchOutputLine:
    """A line (its JSON, the object it parses to, or an OutputLine) read against the schema; raises
    msgspec.ValidationError naming the path of the first field that does not fit."""
    if isinstance(line, OutputLine):
        line = encode_line(line)
    if isinstance(line, bytes | str):
        return _READER.decode(line)
    return msgspec.convert(line, BatchOutputLine)
