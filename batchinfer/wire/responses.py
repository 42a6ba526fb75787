"""`/v1/responses` lines (OpenAI's Responses API) with text-only input, run as chat.

`chat_body` turns a Responses body into the chat body input_line.py checks: `input` (a string, or a list of
message items whose content is a string or input_text / output_text parts) becomes the messages,
`instructions` a system message before them, `max_output_tokens` max_tokens. Fields of the Responses
API batchinfer does not do (tools, reasoning, previous_response_id, non-text input ...) are told
"not supported by batchinfer". `response_object` is the output body: OpenAI's Response object, minimal
(id, object "response", status, output [one message with output_text], usage).
"""

from __future__ import annotations

from batchinfer.wire.json_types import JSONObject, JSONValue
from batchinfer.wire.prompt import Fail
from batchinfer.wire.result_row import Choice

# Responses fields that map onto chat ones as they are
PASS_THROUGH_FIELDS = frozenset({"temperature", "top_p", "metadata", "user", "store", "service_tier", "model",
                                 "stream", "seed", "stop", "top_k", "min_p", "presence_penalty",
                                 "frequency_penalty", "repetition_penalty", "logit_bias"})
NOT_SUPPORTED_RESPONSES_FIELDS = {
    **dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls", "max_tool_calls"), "tool calling"),
    "reasoning": "reasoning", "previous_response_id": "conversation state (previous_response_id)",
    "conversation": "conversation state", "include": "include", "background": "background mode",
    "prompt": "prompt templates", "text": "text format options (use /v1/chat/completions "
    "with response_format for structured output)", "truncation": "truncation",
    "top_logprobs": "logprobs on /v1/responses", "prompt_cache_key": "prompt_cache_key",
    "safety_identifier": "safety_identifier", "stream_options": "streaming",
}  # fmt: skip
_TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})


def chat_body(body: JSONObject, fail: Fail) -> JSONObject:
    """The chat body a text-only Responses body means; raises fail(...) naming the field otherwise."""
    out: JSONObject = {}
    for name, value in body.items():
        if name in PASS_THROUGH_FIELDS:
            out[name] = value
        elif name in NOT_SUPPORTED_RESPONSES_FIELDS:
            raise fail(f"{NOT_SUPPORTED_RESPONSES_FIELDS[name]} is not supported by batchinfer on "
                       f"/v1/responses; remove {name} (batchinfer runs text-only responses)", name)
        elif name == "max_output_tokens":
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise fail(f"must be an integer >= 1, got {value!r:.80}", name)
            if value is not None:
                out["max_tokens"] = value
        elif name not in ("input", "instructions"):
            raise fail("unknown or unsupported field on /v1/responses (check the spelling)", name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise fail(f"must be a string, got {instructions!r:.80}", "instructions")
    messages: list[JSONValue] = [{"role": "system", "content": instructions}] if instructions else []
    out["messages"] = messages + _input_messages(body.get("input"), fail)
    return out


def _input_messages(value: JSONValue, fail: Fail) -> list[JSONValue]:
    if value is None:
        raise fail("missing; a response needs input (a string or a list of messages)", "input",
                   "missing_required_parameter")
    if isinstance(value, str):
        if not value:
            raise fail("must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise fail("must be a string or a non-empty list of message items", "input")
    messages: list[JSONValue] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            kind = item.get("type") if isinstance(item, dict) else None
            raise fail(f"{kind} items are not supported by batchinfer; only text message items "
                       "{\"role\": ..., \"content\": ...}" if isinstance(kind, str)
                       else "must be a message item {\"role\": ..., \"content\": ...}", where)
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind, text = (part.get("type"), part.get("text")) if isinstance(part, dict) else (None, None)
                if kind not in _TEXT_PART_TYPES or not isinstance(text, str):
                    raise fail(f"{kind if isinstance(kind, str) else 'this part'} is not supported by "
                               "batchinfer; only input_text parts {\"type\": \"input_text\", \"text\": ...}",
                               f"{where}.content[{j}]")
                texts.append(text)
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise fail("must be a string or a list of input_text parts", f"{where}.content")
        messages.append({"role": item["role"], "content": content})
    return messages


def response_object(*, request_key: int, created: int, model: str, choice: Choice,
                    prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, object]:
    """OpenAI's Response object for one completion ({text, finish_reason}), with its usage."""
    incomplete = choice["finish_reason"] == "length"
    # The message item's status follows the response's, as OpenAI's does for an output cut at the limit.
    message = {"type": "message", "id": f"msg_batch_{request_key}",
               "status": "incomplete" if incomplete else "completed",
               "role": "assistant",
               "content": [{"type": "output_text", "text": choice["text"], "annotations": []}]}
    return {
        "id": f"resp_batch_{request_key}", "object": "response", "created_at": created,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model, "output": [message],
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                  "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + completion_tokens},
    }
