"""`/v1/embeddings` lines (OpenAI's Embeddings API): the body's checks and the embedding list object.

`read_body` checks an embeddings body at ingest: `input` is a string, a list of strings, a list of token
ids or a list of token-id lists (at most MAX_INPUTS, none empty), `encoding_format` "float" or "base64",
`model` / `user` accepted; `dimensions` is not supported (the model's hidden size is the dimension).
The worker runs each input through the model (Engine.embed: the last hidden state after the final norm,
mean-pooled over the input's tokens and L2-normalised); `embedding_list` is the output body.
"""

from __future__ import annotations

import base64
import struct

from batchinfer.wire.json_types import JSONObject
from batchinfer.wire.prompt import Fail
from batchinfer.wire.request import RequestOptions

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
ENCODING_FORMATS = ("float", "base64")
_ACCEPTED_FIELDS = frozenset({"input", "encoding_format", "model", "user"})


def read_body(body: JSONObject, fail: Fail) -> tuple[RequestOptions, str | None]:
    """(the options a worker needs: input list and encoding_format, body.model) or raise fail(...)."""
    for name in body:
        if name == "dimensions":
            raise fail("dimensions is not supported by batchinfer (embeddings have the model's hidden "
                       "size); remove it", name)
        if name not in _ACCEPTED_FIELDS:
            raise fail("unknown or unsupported field on /v1/embeddings (check the spelling)", name)
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise fail(f"must be one of {list(ENCODING_FORMATS)}, got {encoding!r:.80}", "encoding_format")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise fail(f"must be a model name (a non-empty string), got {model!r:.80}", "model")
    return {"input": _inputs(body.get("input"), fail), "encoding_format": encoding}, model


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                           for t in value)


def _inputs(value: object, fail: Fail) -> list[str | list[int]]:
    if value is None:
        raise fail("missing; an embeddings request needs input (a string or a list of strings)", "input",
                   "missing_required_parameter")
    if isinstance(value, str) or (_is_token_ids(value) and value):
        value = [value]  # one input
    if not isinstance(value, list) or not value:
        raise fail("must be a non-empty string, a non-empty list of strings or a list of token ids", "input")
    if len(value) > MAX_INPUTS:
        raise fail(f"has {len(value)} inputs; at most {MAX_INPUTS} are allowed per line (split it over "
                   "several lines)", "input")
    for i, item in enumerate(value):
        if not (isinstance(item, str) or _is_token_ids(item)):
            raise fail(f"must be a string or a list of token ids, got {type(item).__name__}", f"input[{i}]")
        if not item:
            raise fail("must not be empty", f"input[{i}]")
    return value


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """One embedding as the line asked for it: floats, or base64 of little-endian float32 (OpenAI)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def embedding_list(*, model: str, embeddings: list[list[float] | str],
                   prompt_tokens: int) -> dict[str, object]:
    """OpenAI's embedding list object, with its usage."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
