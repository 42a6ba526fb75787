"""Batch file input lines (OpenAI Batch API) and their normalization; output lines are in output_line.py.

Input, one JSON object per line, either the OpenAI form
    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}
or a shorthand {"messages": [...]} / {"prompt": "..."}, sampling fields at top level, custom_id "line-<n>".

`parse_line` turns a line into a NormalizedRequest or raises LineError naming the field and the fix. Hot
path: value checks left to SamplingParams, built once per distinct set of sampling fields (structured
output fields: structured.py).

Without max_tokens a request runs until the context is full (OpenAI), max_tokens=None. body.model is kept
for the store to route (line_models.py); echo and chat template fields are request_options.py's; the fields
batchinfer knows but does not do are unsupported.py's; /v1/embeddings bodies embeddings.py's;
messages and prompts prompt.py's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import orjson
from cachetools import FIFOCache

from batchinfer.engine.sampling.grammars import DEFAULT_GRAMMAR_BUDGET, GrammarBudget, using_budget
from batchinfer.engine.sampling_params import SamplingParams, SamplingParamsError
from batchinfer.wire import embeddings, request_options, responses
from batchinfer.wire.json_types import JSONObject
from batchinfer.wire.prompt import json_type, read_messages, read_prompt
from batchinfer.wire.request import (
    URL_TO_ENDPOINT,
    ChatMessage,
    Endpoint,
    InputLine,
    LineError,
    NormalizedRequest,
)
from batchinfer.wire.request_options import CHAT_OPTION_FIELDS, COMPLETION_OPTION_FIELDS
from batchinfer.wire.structured import CONSTRAINT_FIELDS, read_constraint
from batchinfer.wire.unsupported import NOT_SUPPORTED_FIELDS

MAX_CUSTOM_ID_CHARS = 512
MAX_N = 128
MAX_METADATA_KEYS = 16
MAX_JSON_DEPTH = 254  # orjson writes at most this many levels (it reads 1024): deeper cannot be stored
ENVELOPE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
SAMPLING_FIELDS = frozenset({
    "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    # vLLM extras
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens", "bad_words",
    "allowed_token_ids", "truncate_prompt_tokens", "logit_bias", "prompt_logprobs", "speculative_decoding",
    "structured_outputs",  # structured output; the other fields asking for it: structured.py
})  # fmt: skip  (speculative_decoding, batchinfer's: false opts a request out of speculation)
CHAT_ONLY_FIELDS = CHAT_OPTION_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
COMPLETION_ONLY_FIELDS = COMPLETION_OPTION_FIELDS | {"prompt", "logprobs"}
ACCEPTED_IGNORED_FIELDS = frozenset({"model", "user", "metadata", "store", "service_tier", "stream"})
CHAT_FIELDS = SAMPLING_FIELDS | CHAT_ONLY_FIELDS | ACCEPTED_IGNORED_FIELDS | CONSTRAINT_FIELDS
COMPLETION_FIELDS = SAMPLING_FIELDS | COMPLETION_ONLY_FIELDS | ACCEPTED_IGNORED_FIELDS | CONSTRAINT_FIELDS


# PostgreSQL text cannot hold NUL, and the custom_id is stored (and echoed in the output) as it is.
_NUL_IN_CUSTOM_ID = "custom_id contains the NUL character (\\u0000); remove it"


# --------------------------------------------------------------------------------------------- input


def parse_line(line: bytes, line_number: int, *, max_metadata_bytes: int = 16 * 1024,
               constraint_budget: GrammarBudget = DEFAULT_GRAMMAR_BUDGET) -> NormalizedRequest:
    """Parse and validate one input line (bytes without the newline) or raise LineError.

    `constraint_budget`: what a structured output constraint may cost (engine/sampling/grammars.py).
    """
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise LineError(f"not valid UTF-8 (byte {bad.start}: {line[bad.start:bad.start + 1]!r}); "
                            "save the file as UTF-8", code="invalid_encoding") from None
        raise LineError(f"invalid JSON: {exc}; each line must be one complete JSON object",
                        code="invalid_json") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {json_type(obj)}", code="invalid_json")
    shorthand = "body" not in obj and "url" not in obj and "method" not in obj
    if shorthand and ("messages" in obj or "prompt" in obj):
        return _parse_shorthand(obj, line_number, max_metadata_bytes, constraint_budget)
    if obj.keys() & ENVELOPE_FIELDS:
        return _parse_envelope(obj, max_metadata_bytes, constraint_budget)
    raise LineError("line has none of custom_id/method/url/body (OpenAI batch form) nor messages/prompt "
                    "(shorthand form)", code="missing_required_parameter")


def _parse_shorthand(obj: JSONObject, line_number: int, max_metadata_bytes: int,
                     budget: GrammarBudget) -> NormalizedRequest:
    custom_id = obj.get("custom_id", f"line-{line_number}")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise LineError(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters, "
                        f"got {custom_id!r:.80}", param="custom_id")
    if "\x00" in custom_id:
        raise LineError(_NUL_IN_CUSTOM_ID, param="custom_id")
    body = obj
    if "custom_id" in obj:
        body = {k: v for k, v in obj.items() if k != "custom_id"}
    url = _SHORTHAND_URLS[Endpoint.CHAT if "messages" in obj else Endpoint.COMPLETIONS]
    return _normalize(InputLine(custom_id, url, body), "", max_metadata_bytes, budget)


def _parse_envelope(obj: JSONObject, max_metadata_bytes: int, budget: GrammarBudget) -> NormalizedRequest:
    custom_id = obj.get("custom_id")
    readable_id = custom_id if isinstance(custom_id, str) and 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS \
        and "\x00" not in custom_id else None

    def fail(message: str, code: str = "invalid_request", param: str | None = None) -> LineError:
        return LineError(message, code=code, param=param, custom_id=readable_id)

    if len(obj) != len(ENVELOPE_FIELDS) or not ENVELOPE_FIELDS.issuperset(obj):
        unknown = obj.keys() - ENVELOPE_FIELDS
        if unknown:
            raise fail(f"unknown field {sorted(unknown)[0]!r}; a batch line has exactly custom_id, method, "
                       "url and body", param=sorted(unknown)[0])
        missing = sorted(ENVELOPE_FIELDS - obj.keys())[0]
        raise fail(f"missing required field {missing!r}", "missing_required_parameter", missing)
    if not isinstance(custom_id, str):
        raise fail(f"custom_id must be a string, got {json_type(custom_id)}", param="custom_id")
    if not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise fail(f"custom_id must be 1 to {MAX_CUSTOM_ID_CHARS} characters, got {len(custom_id)}",
                   param="custom_id")
    if "\x00" in custom_id:
        raise fail(_NUL_IN_CUSTOM_ID, param="custom_id")
    if obj["method"] != "POST":
        raise fail(f"method must be \"POST\", got {obj['method']!r}", "invalid_method", "method")
    url, body = obj["url"], obj["body"]
    if not isinstance(url, str) or url not in URL_TO_ENDPOINT:
        raise fail(f"url {url!r} is not supported; use one of {sorted(URL_TO_ENDPOINT)}", "invalid_url",
                   "url")
    if not isinstance(body, dict):
        raise fail(f"body must be a JSON object, got {json_type(body)}", param="body")
    return _normalize(InputLine(custom_id, url, body), "body.", max_metadata_bytes, budget)


_SHORTHAND_URLS = {endpoint: url for url, endpoint in URL_TO_ENDPOINT.items()}


def _normalize(line: InputLine, where: str, max_metadata_bytes: int,
               budget: GrammarBudget) -> NormalizedRequest:
    """The NormalizedRequest of a checked envelope; `where` prefixes a field's name in errors ("body.")."""
    custom_id, endpoint, body = line.custom_id, URL_TO_ENDPOINT[line.url], line.body
    readable_id = custom_id or None

    def fail(message: str, param: str, code: str = "invalid_request") -> LineError:
        return LineError(f"{where}{param}: {message}", code=code, param=where + param, custom_id=readable_id)

    if endpoint is Endpoint.EMBEDDINGS:  # no sampling; the input travels in options
        return NormalizedRequest(custom_id, endpoint, None, None, _EMBEDDING_PARAMS,
                                 *embeddings.read_body(body, fail))
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    if endpoint is Endpoint.RESPONSES:
        body = responses.chat_body(body, fail)
    if endpoint is not Endpoint.COMPLETIONS:
        if "prompt" in body:
            raise fail("unknown or unsupported field (prompt belongs to /v1/completions)", "prompt")
        messages = read_messages(body.get("messages"), fail)
    else:
        if "messages" in body:
            raise fail("unknown or unsupported field (messages belong to /v1/chat/completions)", "messages")
        prompt = read_prompt(body.get("prompt"), fail)
    options = {k: v for k, v in body.items() if k not in _PROMPT_AND_METADATA}
    if "metadata" in body:
        try:
            validate_metadata(body["metadata"], max_bytes=max_metadata_bytes)
        except ValueError as exc:
            raise fail(str(exc), "metadata") from None
    # Files repeat a handful of sampling configurations: build (and so validate) each distinct one once
    # and share it. The key is the JSON text, so 1, 1.0 and true stay distinct.
    try:
        key = (endpoint, orjson.dumps(options), *astuple_budget(budget))
    except orjson.JSONEncodeError:  # orjson writes 254 levels but reads 1024: the row could not be stored
        raise _too_deep(options, fail) from None
    entry = _OPTIONS_CACHE.get(key)  # a read needs no lock: FIFO order does not move on a hit
    if entry is None:
        with using_budget(budget):
            checked = _check_options(endpoint, options)
        stored = checked.to_dict() if isinstance(checked, SamplingParams) else None
        entry = (checked, stored, _OPTIONS_ENTRY_FACTOR * len(key[1]) + 512)
        with _OPTIONS_LOCK, contextlib.suppress(ValueError):  # ValueError: larger than the whole cache
            _OPTIONS_CACHE[key] = entry
    checked, stored = entry[0], entry[1]
    if isinstance(checked, LineError):
        raise fail(checked.message, checked.param or "", checked.code)
    try:
        extra = request_options.read_request_options(body)
    except request_options.RequestOptionError as exc:
        raise fail(exc.message, exc.field, "invalid_value") from None
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise fail(f"must be a model name (a non-empty string), got {json_type(model)}", "model")
    return NormalizedRequest(custom_id, endpoint, messages, prompt, checked, extra, model, stored)


_PROMPT_AND_METADATA = frozenset({"messages", "prompt", "metadata"})
_EMBEDDING_PARAMS = SamplingParams(max_tokens=None)
# Bounded in bytes: an entry holds its JSON text and the values parsed from it (the factor), so one
# distinct 1 MB line costs ~5 MB here and the whole cache at most OPTIONS_CACHE_BYTES.
OPTIONS_CACHE_BYTES = 64 << 20
_OPTIONS_ENTRY_FACTOR = 5
# key: (endpoint, the options' JSON, the grammar budget); entry: (checked, its to_dict, bytes counted)
_OPTIONS_CACHE: FIFOCache[tuple[Endpoint, bytes, int, int, float],
                          tuple[SamplingParams | LineError, JSONObject | None, int]] = \
    FIFOCache(maxsize=OPTIONS_CACHE_BYTES, getsizeof=lambda entry: entry[2])
_OPTIONS_LOCK = threading.Lock()  # writes: the API ingests on several threads (reads are dict reads)


def astuple_budget(budget: GrammarBudget) -> tuple[int, int, float]:
    """The budget's values, for a cache key (plain values hash faster than the dataclass)."""
    return budget.max_depth, budget.max_bytes, budget.timeout_s


def _too_deep(options: JSONObject, fail: Callable[[str, str], LineError]) -> LineError:
    """The error of a body whose field nests deeper than a stored request may (MAX_JSON_DEPTH)."""
    for name in sorted(options):
        try:
            orjson.dumps(options[name])
        except orjson.JSONEncodeError:
            return fail(f"nests more than {MAX_JSON_DEPTH} levels deep (the JSON nesting limit of a stored "
                        "request); flatten it", name)
    return fail(f"the body nests more than {MAX_JSON_DEPTH} levels deep; flatten it", "body")


def _check_options(endpoint: Endpoint, options: JSONObject) -> SamplingParams | LineError:
    """The SamplingParams of a body's non-prompt fields, or the LineError (without location) they earn."""
    chat = endpoint is not Endpoint.COMPLETIONS  # responses were turned into chat bodies
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = options.keys() - allowed
    if unknown:
        known = sorted(unknown & NOT_SUPPORTED_FIELDS.keys())
        if known:
            return LineError(f"{NOT_SUPPORTED_FIELDS[known[0]]} is not supported by batchinfer; remove "
                             f"{known[0]} (batchinfer runs text generation)", param=known[0])
        return LineError("unknown or unsupported field (check the spelling)", param=sorted(unknown)[0])
    if options.get("stream"):
        return LineError("streaming is not available in a batch; remove it or set it to false",
                         param="stream")
    # SamplingParams' keyword arguments, as the JSON gave them: SamplingParams checks each value itself
    # at run time (so Any: the checker cannot match free JSON to its typed fields)
    params: dict[str, Any] = {name: options[name] for name in SAMPLING_FIELDS.intersection(options)}
    if "max_completion_tokens" in options:
        if "max_tokens" in options and options["max_tokens"] != options["max_completion_tokens"]:
            return LineError("give max_tokens or max_completion_tokens, not both with different values",
                             param="max_completion_tokens")
        params["max_tokens"] = options["max_completion_tokens"]
    params.setdefault("max_tokens", None)  # OpenAI: no limit but the context
    temperature = params.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature > 2:
        return LineError(f"must be between 0 and 2, got {temperature}", param="temperature")
    if isinstance(params.get("n"), int) and params["n"] > MAX_N:
        return LineError(f"must be at most {MAX_N}, got {params['n']}", param="n")
    if chat:
        error = _chat_logprobs(options, params)
        if error is not None:
            return error
    elif options.get("logprobs") is not None:
        params["logprobs"] = options["logprobs"]  # completions: an int, the number of top logprobs
    try:
        if not CONSTRAINT_FIELDS.isdisjoint(options):
            params["structured_outputs"] = read_constraint(options, chat=chat)
        return SamplingParams(**params)
    except SamplingParamsError as exc:
        return LineError(exc.message, code="invalid_value", param=exc.field)


def check_sampling_fields(fields: JSONObject) -> None:
    """Check body fields to be added to lines that lack them (schedule defaults), as parse_line would.

    Only sampling fields may be given. They are valid when one endpoint accepts them (chat's logprobs is
    a boolean, completions' a count). Raises the LineError the line would get, chat's when both refuse.
    """
    unknown = fields.keys() - _DEFAULTABLE_FIELDS
    if unknown:
        allowed = ", ".join(sorted(_DEFAULTABLE_FIELDS))
        raise LineError(f"not a sampling field; defaults may set only {allowed}", param=sorted(unknown)[0])
    checked = [_check_options(endpoint, fields) for endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)]
    errors = [result for result in checked if isinstance(result, LineError)]
    if len(errors) == len(checked):
        raise errors[0]


_DEFAULTABLE_FIELDS = SAMPLING_FIELDS | CONSTRAINT_FIELDS | {"max_completion_tokens", "logprobs",
                                                              "top_logprobs"}
def _chat_logprobs(options: JSONObject, params: dict[str, object]) -> LineError | None:
    logprobs, top = options.get("logprobs"), options.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        return LineError(f"must be true or false for chat (use top_logprobs for a count), got {logprobs!r}",
                         param="logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
            return LineError(f"must be an integer from 0 to 20, got {top!r}", param="top_logprobs")
        if not logprobs:
            return LineError("needs logprobs: true", param="top_logprobs")
    if logprobs:
        params["logprobs"] = top or 0
    return None


def validate_metadata(metadata: object, *, max_bytes: int) -> dict[str, str] | None:
    """OpenAI metadata rules: up to 16 string keys (<= 64 chars) and string values (<= 512 chars), small."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be an object of string keys and values, got {json_type(metadata)}")
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise ValueError(f"metadata[{key!r}]: keys must be <= 64 chars and values strings <= 512 chars")
    size = len(orjson.dumps(metadata))
    if size > max_bytes:
        raise ValueError(f"metadata is {size} bytes; the limit is {max_bytes} (max_metadata_bytes)")
    return metadata
