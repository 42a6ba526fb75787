"""One request as it crosses batchinfer's boundaries: the input line's envelope, the normalized request
parse_line makes of it, and the stored payload (the requests table's `payload` column) a worker reads back.

The models are msgspec Structs: measured against pydantic and plain dicts on the ingest and export paths
(bench/wire_models.py), a Struct costs least to build and encode, and decoding the stored payload checks
its shape where a worker reads it. `LineError` is a line's error, with its field (`param`) as data.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NotRequired, TypedDict

import msgspec

from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.wire.json_types import JSONObject


class Endpoint(StrEnum):
    """The supported endpoints; the value is what the requests table stores. Responses run as chat."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # text-only /v1/responses: responses.py turns the body into a chat one
    EMBEDDINGS = "embeddings"  # /v1/embeddings: embeddings.py checks the body, options hold the input


URL_TO_ENDPOINT = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETIONS,
                   "/v1/responses": Endpoint.RESPONSES, "/v1/embeddings": Endpoint.EMBEDDINGS}
ENDPOINT_TO_URL = {endpoint: url for url, endpoint in URL_TO_ENDPOINT.items()}


class LineError(ValueError):
    """A line (or body) that cannot run. `code` is machine-readable, the message says what to fix."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None,
                 custom_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.custom_id = custom_id  # the line's own custom_id when it could be read


class LineErrorEntry(TypedDict):
    """A bad line as a job's `errors` list records it (OpenAI's batch errors): the field as data."""

    code: str
    message: str
    line: int
    param: str | None


class InputLine(msgspec.Struct, frozen=True):
    """An input line's envelope once its fields are checked: the OpenAI form as written, or the shorthand
    form ({"messages"} / {"prompt"}, sampling fields beside them) with its url and custom_id filled in."""

    custom_id: str
    url: str  # a key of URL_TO_ENDPOINT
    body: JSONObject  # the request body as the user wrote it (free-form JSON, checked field by field)


class ChatMessage(TypedDict):
    """One chat message as a worker reads it: content parts are joined into one string at ingest."""

    role: str
    content: str
    name: NotRequired[str]


class RequestOptions(TypedDict, total=False):
    """What a request carries beside its SamplingParams: chat template and echo options
    (request_options.py), or an embeddings request's inputs and their encoding (embeddings.py). Values at
    their defaults are left out."""

    echo: bool
    add_generation_prompt: bool
    chat_template_kwargs: JSONObject
    input: list[str | list[int]]
    encoding_format: str


class StoredRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The requests table's `payload`: what a worker needs to run a request (messages or prompt, the
    SamplingParams' to_dict, the options). Encoded once at ingest; decoded (shape checked) by the worker."""

    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    params: JSONObject  # SamplingParams.to_dict(): SamplingParams.from_dict rebuilds it without checking
    options: RequestOptions | None = None

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams, rebuilt from what ingest stored (checked there, not again)."""
        return SamplingParams.from_dict(self.params)


class NormalizedRequest(msgspec.Struct):
    """One validated request: what a worker needs to run it."""

    custom_id: str
    endpoint: Endpoint
    messages: list[ChatMessage] | None
    prompt: str | list[int] | None
    params: SamplingParams  # shared with other requests of the same sampling fields (it is frozen)
    options: RequestOptions | None = None  # echo, chat template arguments (request_options.py)
    model: str | None = None  # body.model: the store routes the line to it (store/line_models.py)
    stored_params: JSONObject | None = None  # params.to_dict(), shared like params (None: not computed)

    def prefix_text(self) -> str:
        """The text a prompt starts with, as the model will see it (for grouping shared prefixes)."""
        if self.messages is not None:
            return "".join(f"<{m['role']}>{m['content']}\n" for m in self.messages)
        if isinstance(self.prompt, str):
            return self.prompt
        return " ".join(map(str, self.prompt or ()))

    def payload(self) -> StoredRequest:
        """What the requests table stores for a worker: the prompt or messages, the params, the options."""
        params = self.stored_params if self.stored_params is not None else self.params.to_dict()
        return StoredRequest(messages=self.messages, prompt=self.prompt, params=params, options=self.options)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(StoredRequest)


def encode_stored(request: NormalizedRequest) -> str:
    """The request's payload as the JSON text of the requests table's `payload` column."""
    return _ENCODER.encode(request.payload()).decode()


def decode_stored(payload: str | bytes) -> StoredRequest:
    """A stored payload read back (raises msgspec.ValidationError when its shape is not a payload's)."""
    return _DECODER.decode(payload)
