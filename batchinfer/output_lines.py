"""Output and error lines of a batch (OpenAI Batch API): the builders export uses, and their schema.

`response_body` turns a worker's choices into a chat.completion / text_completion / response object, which the
requests table stores; `output_line` and `error_line` wrap it (or an error) into a line of the output
or error file. The pydantic models below state that line's shape; they validate nothing on the hot
path (building dicts is cheaper) and serve readers and the tests that check export's lines.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel

from batchinfer.embedding_lines import embedding_list
from batchinfer.formats import Endpoint
from batchinfer.responses_lines import response_object


def response_body(*, endpoint: str, model: str, request_key: int, created: int, choices: list[dict[str, Any]],
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                  embeddings: list[Any] | None = None,
                  prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
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
    out_choices = [{"index": c.get("index", i), "text": c["text"], "logprobs": c.get("logprobs"),
                    "finish_reason": c["finish_reason"]} for i, c in enumerate(choices)]
    if prompt_logprobs is not None:
        for choice in out_choices:
            choice["prompt_logprobs"] = prompt_logprobs
    return {"id": f"cmpl-batch-{request_key}", "object": "text_completion", "created": created,
            "model": model, "choices": out_choices, "usage": usage}


def output_line(*, request_key: int, custom_id: str,
                body: dict[str, Any] | orjson.Fragment) -> dict[str, Any]:
    """A success line of the output file (`body` may be pre-serialized JSON as an orjson.Fragment)."""
    return {"id": f"batch_req_{request_key}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"req_{request_key}", "body": body}, "error": None}


def error_line(*, request_key: int, custom_id: str, code: str, message: str | None) -> dict[str, Any]:
    """A line of the error file: same shape as a success line, response null."""
    return {"id": f"batch_req_{request_key}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


# ------------------------------------------------------------------------------- schema of a line


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ResponseBody(BaseModel):
    id: str
    object: Literal["chat.completion", "text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # chat lines that asked (vLLM)


class ResponseObject(BaseModel):
    """A /v1/responses line's body (responses_lines.response_object)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any]


class EmbeddingList(BaseModel):
    """A /v1/embeddings line's body (embedding_lines.embedding_list)."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    model: str
    usage: dict[str, int]


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: ResponseBody | ResponseObject | EmbeddingList


class BatchError(BaseModel):
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """A line of the output file (response set, error null) or of the error file (response null)."""

    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchError | None
