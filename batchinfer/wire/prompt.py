"""A body's prompt, as parse_line reads it: chat messages (text parts joined into one string) and completion
prompts (a string or token ids). Each reader raises the error its `fail(message, param, code=...)` builds,
so the line's location and custom_id stay input_line.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

from batchinfer.wire.request import ChatMessage
from batchinfer.wire.unsupported import NOT_SUPPORTED_PARTS

Fail = Callable[..., Exception]  # input_line.py's fail(message, param, code=...)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MESSAGE_FIELDS = frozenset({"role", "content", "name"})
_NOT_SUPPORTED_MESSAGE_FIELDS = frozenset({"tool_calls", "tool_call_id", "function_call", "audio",
                                           "refusal"})


def read_messages(messages: object, fail: Fail) -> list[ChatMessage]:
    """A chat body's messages checked, content parts joined into one string (the list copied, not edited)."""
    if messages is None:
        raise fail("missing; a chat request needs a non-empty list of messages", "messages",
                   "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise fail(f"must be a non-empty list of {{role, content}} objects, got {json_type(messages)}",
                   "messages")
    out: list[object] = messages
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise fail(f"must be an object with role and content, got {json_type(message)}",
                       f"messages[{i}]")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise fail(f"role {role!r} is not one of {sorted(CHAT_ROLES)}", f"messages[{i}].role")
        if len(message) > 2 and not _MESSAGE_FIELDS.issuperset(message):
            extra = sorted(message.keys() - _MESSAGE_FIELDS)[0]
            if extra in _NOT_SUPPORTED_MESSAGE_FIELDS:
                raise fail(f"{extra} is not supported by batchinfer (text chat: role, content, name)",
                           f"messages[{i}].{extra}")
            raise fail(f"field {extra!r} is not supported (text chat: role, content, name)", f"messages[{i}]")
        if "name" in message and not isinstance(message["name"], str):
            raise fail(f"must be a string, got {json_type(message['name'])}", f"messages[{i}].name")
        if isinstance(content, str):
            continue
        if isinstance(content, list) and content:
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if isinstance(kind, str) and kind in NOT_SUPPORTED_PARTS:
                        raise fail(f"{NOT_SUPPORTED_PARTS[kind]} is not supported by batchinfer; only text "
                                   "parts {\"type\": \"text\", \"text\": ...}", f"messages[{i}].content[{j}]")
                    raise fail("only text parts {\"type\": \"text\", \"text\": ...} are supported",
                               f"messages[{i}].content[{j}]")
                texts.append(part["text"])
            if out is messages:
                out = list(messages)  # copy before rewriting content parts to one string
            out[i] = {**message, "content": "\n".join(texts)}
            continue
        raise fail(f"must be a string or a list of text parts, got {json_type(content)}",
                   f"messages[{i}].content")
    return cast(list[ChatMessage], out)  # each one checked above: role, content a string, name a string


def read_prompt(prompt: object, fail: Fail) -> str | list[int]:
    """A completion body's prompt: a non-empty string (or a list of one) or a list of token ids."""
    if prompt is None:
        raise fail("missing; a completion request needs a prompt string", "prompt",
                   "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise fail("must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise fail("one prompt per line: put each prompt on its own line", "prompt")
    raise fail(f"must be a string or a list of token ids, got {json_type(prompt)}", "prompt")



def json_type(value: object) -> str:
    """How an error message names a JSON value's type (\"an array\", \"a non-finite number\")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number" if math.isfinite(value) else "a non-finite number"
    names: dict[type, str] = {str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)
