"""Fields of OpenAI's and vLLM's APIs that batchinfer does not do are told "not supported by batchinfer",
not "check the spelling" (issue 18); a real misspelling still is."""

from __future__ import annotations

import orjson
import pytest

from batchinfer.wire.input_line import NOT_SUPPORTED_FIELDS, parse_line
from batchinfer.wire.request import LineError

USER = [{"role": "user", "content": "hi"}]


def _error(body: dict, url: str = "/v1/chat/completions") -> LineError:
    line = orjson.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body})
    with pytest.raises(LineError) as caught:
        parse_line(line, 7)
    return caught.value


@pytest.mark.parametrize(("field", "value", "what"), [
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tool calling"),
    ("tool_choice", "auto", "tool calling"),
    ("functions", [], "tool calling"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio output"),
    ("modalities", ["text", "audio"], "audio output"),
    ("prediction", {"type": "content", "content": "x"}, "predicted outputs"),
])
def test_unsupported_chat_fields_say_so(field: str, value: object, what: str) -> None:
    error = _error({"messages": USER, field: value})
    assert error.message == (f"body.{field}: {what} is not supported by batchinfer; remove {field} "
                             "(batchinfer runs text generation)")
    assert error.code == "invalid_request" and error.param == f"body.{field}"
    assert "spelling" not in error.message


def test_unsupported_completion_fields_and_vllm_fields_say_so() -> None:
    assert "suffix (insertion) is not supported by batchinfer" in _error({"prompt": "x", "suffix": "y"},
                                                                        "/v1/completions").message
    assert "not supported by batchinfer" in _error({"messages": USER, "use_beam_search": True}).message
    assert all(isinstance(what, str) and what for what in NOT_SUPPORTED_FIELDS.values())


@pytest.mark.parametrize(("part", "what"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image input"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio input"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file input"),
])
def test_image_audio_and_file_parts_say_so(part: dict, what: str) -> None:
    error = _error({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]})
    assert error.message.startswith(f"body.messages[0].content[1]: {what} is not supported by batchinfer")
    assert error.code == "invalid_request"


def test_tool_messages_say_so_and_misspellings_still_get_the_spelling_hint() -> None:
    error = _error({"messages": [{"role": "assistant", "content": "", "tool_calls": []}]})
    assert "tool_calls is not supported by batchinfer" in error.message
    misspelled = _error({"messages": USER, "temprature": 0.5})
    assert misspelled.message == "body.temprature: unknown or unsupported field (check the spelling)"
    odd_part = _error({"messages": [{"role": "user", "content": [{"type": ["image"]}]}]})
    assert "only text parts" in odd_part.message  # an unhashable type is a plain bad part, not a crash
